//! The cocoon calls of one create: answers shared between creates of one image (the snapshot
//! and image facts, `read_facts`) and what drops them.

use super::*;

const SNAP: &str = r#"{"id":"S","name":"team/agent:v3","hypervisor":"cloud-hypervisor"}"#;

/// A fresh managed pod of `vm` up to the step after its `snapshot rm fork-*`: the effects that
/// follow (normally the image's `snapshot inspect`, unless a kept answer stood).
fn to_source(h: &mut H, name: &str, vm: &str, extra: &[(&'static str, String)]) -> Vec<Effect> {
    let mut ann = managed(name, vm);
    ann.extend(extra.iter().cloned());
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        name,
        &format!("u-{name}"),
        &ann,
    ))));
    let e = no_evidence(h, &e);
    answer(h, &e, &format!("snapshot rm fork-{vm}"), Answer::ok(""))
}

fn clones(e: &[Effect]) -> usize {
    cocoon_ops(e)
        .iter()
        .filter(|(_, c)| matches!(c, CocoonCmd::VmClone(_)))
        .count()
}

fn inspects(e: &[Effect]) -> usize {
    cocoon_ops(e)
        .iter()
        .filter(|(_, c)| matches!(c, CocoonCmd::SnapshotInspect { .. }))
        .count()
}

/// Pod `a`'s create asks for the image's snapshot, answered with [`SNAP`]: the effects after.
fn inspected_first_create(h: &mut H) -> Vec<Effect> {
    let e = to_source(h, "a", "vk-ns-demo-0", &[]);
    answer(h, &e, "snapshot inspect team/agent:v3", Answer::ok(SNAP))
}

#[test]
fn creates_of_one_image_share_its_snapshot_inspect() {
    let mut h = H::new(ProviderConfig::default());
    let e = inspected_first_create(&mut h);
    assert_eq!(clones(&e), 1);
    // The next create of the image asks nothing: it clones at once.
    let e = to_source(&mut h, "b", "vk-ns-demo-1", &[]);
    assert_eq!(inspects(&e), 0, "{e:?}");
    assert_eq!(clones(&e), 1, "{e:?}");
}

#[test]
fn a_kept_snapshot_answer_ages_out() {
    let mut h = H::new(ProviderConfig::default());
    inspected_first_create(&mut h);
    h.now += Duration::from_secs(31);
    h.wall += Duration::from_secs(31);
    let e = to_source(&mut h, "b", "vk-ns-demo-1", &[]);
    assert_eq!(inspects(&e), 1, "a fresh read after the facts' age: {e:?}");
}

#[test]
fn a_failed_clone_forgets_the_kept_answers() {
    let mut h = H::new(ProviderConfig::default());
    let e = inspected_first_create(&mut h);
    let (op, _) = one_cocoon(&e);
    h.cocoon(op, Answer::failed("Error: clone: snapshot not found"));
    let e = to_source(&mut h, "b", "vk-ns-demo-1", &[]);
    assert_eq!(inspects(&e), 1, "the snapshot may be gone: {e:?}");
}

/// A pull replaces the local snapshot (a tag re-pushed to the registry reaches the node only
/// through one): the answer read before it is dropped, and so is one read while it ran.
#[test]
fn a_pull_of_the_snapshot_forces_a_fresh_read() {
    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    inspected_first_create(&mut h);
    // force-pull: the kept answer is older than this create, so the snapshot is pulled again.
    let force = [(ANN_FORCE_PULL, "true".to_string())];
    let e = to_source(&mut h, "b", "vk-ns-demo-1", &force);
    assert_eq!(inspects(&e), 0, "the kept answer is used: {e:?}");
    let e = base_manifest(&mut h, &e);
    let pull = e
        .iter()
        .find_map(|x| match x {
            Effect::PullSnapshot { op, .. } => Some(*op),
            _ => None,
        })
        .expect("a pull");
    // While it runs, another create reads afresh (and that answer is not kept).
    let e = to_source(&mut h, "c", "vk-ns-demo-2", &[]);
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect team/agent:v3",
        Answer::ok(SNAP),
    );
    assert_eq!(clones(&e), 1);
    let e = h.feed(Input::TransferDone {
        op: pull,
        result: Ok(String::new()),
    });
    answer(
        &mut h,
        &e,
        "snapshot inspect team/agent:v3",
        Answer::ok(SNAP),
    );
    let e = to_source(&mut h, "d", "vk-ns-demo-3", &[]);
    assert_eq!(inspects(&e), 1, "read again after the pull: {e:?}");
}

/// A removal (or a save) of the snapshot name drops its kept answer; another name's does not.
#[test]
fn a_removal_or_save_of_the_snapshot_forces_a_fresh_read() {
    for (change, drops) in [
        (
            CocoonCmd::SnapshotRm {
                name: "team/agent:v3".into(),
            },
            true,
        ),
        (
            CocoonCmd::SnapshotSave {
                name: "team/agent:v3".into(),
                vm_id: "X".into(),
                deadline: None,
            },
            true,
        ),
        (
            CocoonCmd::SnapshotRm {
                name: "other".into(),
            },
            false,
        ),
    ] {
        let mut facts = super::super::read_facts::ReadFacts::default();
        let read = CocoonCmd::SnapshotInspect {
            name: "team/agent:v3".into(),
        };
        let now = Instant::now();
        facts.read_issued(&read, now);
        facts.read_answered(&read.argv(), &Answer::ok(SNAP));
        assert!(facts.answer(&read, now, &[]).is_some());
        let effect = Effect::Cocoon { op: 7, cmd: change };
        // Issued in the same input: already counted.
        assert_eq!(
            facts
                .answer(&read, now, std::slice::from_ref(&effect))
                .is_none(),
            drops
        );
        facts.note_effects(std::slice::from_ref(&effect));
        assert_eq!(facts.answer(&read, now, &[]).is_none(), drops);
        // A read while the change runs is not kept; after its answer, reads are kept again.
        facts.read_issued(&read, now);
        facts.read_answered(&read.argv(), &Answer::ok(SNAP));
        assert_eq!(facts.answer(&read, now, &[]).is_none(), drops);
        let done = Input::CocoonDone {
            op: 7,
            result: Answer::ok(""),
        };
        facts.note_input(&done, now);
        facts.read_issued(&read, now);
        facts.read_answered(&read.argv(), &Answer::ok(SNAP));
        assert!(facts.answer(&read, now, &[]).is_some());
    }
}

/// An image pull or materialisation drops every kept image answer.
#[test]
fn an_image_pull_forces_a_fresh_image_read() {
    let mut facts = super::super::read_facts::ReadFacts::default();
    let read = CocoonCmd::ImageInspect {
        reference: "sha256:ab".into(),
    };
    let now = Instant::now();
    facts.read_issued(&read, now);
    facts.read_answered(&read.argv(), &Answer::ok("{}"));
    assert!(facts.answer(&read, now, &[]).is_some());
    let pull = Effect::MaterialiseImage {
        op: 3,
        image: "ubuntu:24.04".into(),
        force: true,
    };
    facts.note_effects(&[pull]);
    assert!(facts.answer(&read, now, &[]).is_none());
    // A failed answer is never kept.
    facts.note_input(
        &Input::TransferDone {
            op: 3,
            result: Ok(String::new()),
        },
        now,
    );
    facts.read_issued(&read, now);
    facts.read_answered(
        &read.argv(),
        &Answer::failed("Error: not found in any backend"),
    );
    assert!(facts.answer(&read, now, &[]).is_none());
}
