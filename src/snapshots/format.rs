//! Snapshot and cloud-image artifact formats: media types, config blob,
//! `snapshot.json` envelope, classification and manifest building. Pure data, no I/O.

use std::collections::{BTreeMap, HashMap};

use oci_spec::image::{
    Descriptor, Digest, ImageIndex, ImageManifest, ImageManifestBuilder, MediaType,
};
use serde::{Deserialize, Serialize};

use super::TransferError;

pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_LIST_MEDIA_TYPE: &str =
    "application/vnd.docker.distribution.manifest.list.v2+json";
pub const SNAPSHOT_V1: &str = "application/vnd.cocoonstack.snapshot.v1+json";
pub const SNAPSHOT_V2: &str = "application/vnd.cocoonstack.snapshot.v2+json";
pub const SNAPSHOT_CONFIG: &str = "application/vnd.cocoonstack.snapshot.config.v1+json";
pub const OS_IMAGE: &str = "application/vnd.cocoonstack.os-image.v1+json";
pub const WINDOWS_IMAGE: &str = "application/vnd.cocoonstack.windows-image.v1+json";
pub const TITLE: &str = "org.opencontainers.image.title";
pub const CREATED: &str = "org.opencontainers.image.created";
pub const BASEIMAGE: &str = "cocoonstack.snapshot.baseimage";
pub const FROM_NODE: &str = "cocoonstack.snapshot.from-node";
/// The namespace (and pod) a pushed VM snapshot belongs to.
pub const OWNER_NAMESPACE: &str = "cocoonstack.snapshot.owner-namespace";
pub const OWNER_POD_UID: &str = "cocoonstack.snapshot.owner-pod-uid";
pub const CHUNK_INDEX: &str = "cocoonstack.chunk.index";
pub const CHUNK_COUNT: &str = "cocoonstack.chunk.count";
pub const SPARSE_MAP: &str = "COCOON.sparse.map";
pub const SPARSE_SIZE: &str = "COCOON.sparse.size";
/// Readers cap the config blob at 64 MiB.
pub const CONFIG_LIMIT: u64 = 64 << 20;

/// The seven base layer types a snapshot reader accepts (each also with `+zstd`).
pub const SNAPSHOT_LAYER_TYPES: [&str; 7] = [
    "application/vnd.cocoonstack.vm.config+json",
    "application/vnd.cocoonstack.vm.state+json",
    "application/vnd.cocoonstack.vm.memory",
    "application/vnd.cocoonstack.vm.cidata",
    "application/vnd.cocoonstack.disk.qcow2",
    "application/vnd.cocoonstack.disk.raw",
    "application/octet-stream",
];

/// Cloud-image disk layer types; other layers are ignored.
pub const DISK_LAYER_TYPES: [&str; 8] = [
    "application/vnd.cocoonstack.disk.qcow2",
    "application/vnd.cocoonstack.disk.qcow2.part",
    "application/vnd.cocoonstack.disk.raw",
    "application/vnd.cocoonstack.disk.raw.part",
    "application/vnd.cocoonstack.windows.disk.qcow2",
    "application/vnd.cocoonstack.windows.disk.qcow2.part",
    "application/vnd.cocoonstack.windows.disk.raw",
    "application/vnd.cocoonstack.windows.disk.raw.part",
];

/// Base media type for an export file name.
pub fn media_type_for(name: &str) -> &'static str {
    let base = name.rsplit('/').next().unwrap_or(name);
    match base {
        "config.json" => SNAPSHOT_LAYER_TYPES[0],
        "state.json" => SNAPSHOT_LAYER_TYPES[1],
        "memory-ranges" => SNAPSHOT_LAYER_TYPES[2],
        "cidata.img" => SNAPSHOT_LAYER_TYPES[3],
        n if n.ends_with(".qcow2") => SNAPSHOT_LAYER_TYPES[4],
        n if n.ends_with(".raw") => SNAPSHOT_LAYER_TYPES[5],
        _ => SNAPSHOT_LAYER_TYPES[6],
    }
}

/// What a manifest is (first match wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArtifactKind {
    CloudImage,
    SnapshotV1,
    SnapshotV2,
    ContainerImage,
    ImageIndex,
    Unknown,
}

impl ArtifactKind {
    pub fn is_snapshot(self) -> bool {
        matches!(self, ArtifactKind::SnapshotV1 | ArtifactKind::SnapshotV2)
    }
    pub fn name(self) -> &'static str {
        match self {
            ArtifactKind::CloudImage => "a cloud image",
            ArtifactKind::SnapshotV1 | ArtifactKind::SnapshotV2 => "a snapshot",
            ArtifactKind::ContainerImage => "a container image",
            ArtifactKind::ImageIndex => "an image index",
            ArtifactKind::Unknown => "of unknown kind",
        }
    }
}

/// Layers (or index children) a manifest may list. A snapshot of a 1 TiB disk in 64 MiB
/// chunks is 16,384 layers; more is refused before the list is parsed into descriptors.
pub const MAX_MANIFEST_ENTRIES: usize = 16_384;

/// What a manifest's top level says, read in one pass without building a JSON tree: the
/// `layers` and `manifests` lists are only counted, annotation values other than strings are
/// skipped. The body may be up to 100 MiB; a tree of it would take several times that.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ManifestHead {
    pub artifact_type: Option<String>,
    pub media_type: Option<String>,
    pub config: Option<ConfigHead>,
    pub layers: Option<Counted>,
    pub manifests: Option<Counted>,
    pub annotations: Option<BTreeMap<String, StringOnly>>,
}

/// `config.mediaType` of a manifest.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ConfigHead {
    pub media_type: Option<String>,
}

/// A JSON array seen only for its length.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counted(pub usize);

impl<'de> Deserialize<'de> for Counted {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Count;
        impl<'de> serde::de::Visitor<'de> for Count {
            type Value = Counted;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<Counted, A::Error> {
                let mut n = 0;
                while a.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(Counted(n))
            }
        }
        d.deserialize_seq(Count)
    }
}

/// A JSON value kept only when it is a string (annotation values).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StringOnly(pub Option<String>);

impl<'de> Deserialize<'de> for StringOnly {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Keep;
        impl<'de> serde::de::Visitor<'de> for Keep {
            type Value = StringOnly;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<StringOnly, E> {
                Ok(StringOnly(Some(v.to_string())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<StringOnly, E> {
                Ok(StringOnly(Some(v)))
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<StringOnly, E> {
                Ok(StringOnly(None))
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<StringOnly, E> {
                Ok(StringOnly(None))
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<StringOnly, E> {
                Ok(StringOnly(None))
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<StringOnly, E> {
                Ok(StringOnly(None))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<StringOnly, E> {
                Ok(StringOnly(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<StringOnly, A::Error> {
                while a.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(StringOnly(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<StringOnly, A::Error> {
                while a
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(StringOnly(None))
            }
        }
        d.deserialize_any(Keep)
    }
}

impl ManifestHead {
    /// The string annotations.
    pub fn string_annotations(&self) -> BTreeMap<String, String> {
        self.annotations
            .iter()
            .flatten()
            .filter_map(|(k, v)| v.0.clone().map(|v| (k.clone(), v)))
            .collect()
    }
}

/// Reads a manifest's head; refuses one that lists more than `MAX_MANIFEST_ENTRIES`.
pub fn read_head(body: &[u8], what: &str) -> Result<ManifestHead, TransferError> {
    let head: ManifestHead = serde_json::from_slice(body)
        .map_err(|e| TransferError::Format(format!("{what}: manifest is not JSON: {e}")))?;
    let entries = head
        .layers
        .unwrap_or_default()
        .0
        .max(head.manifests.unwrap_or_default().0);
    if entries > MAX_MANIFEST_ENTRIES {
        return Err(TransferError::Format(format!(
            "{what}: manifest lists {entries} entries, at most {MAX_MANIFEST_ENTRIES}"
        )));
    }
    Ok(head)
}

/// Classifies a manifest by its head.
pub fn classify(doc: &ManifestHead) -> ArtifactKind {
    let artifact = doc.artifact_type.as_deref().unwrap_or("");
    match artifact {
        OS_IMAGE | WINDOWS_IMAGE => return ArtifactKind::CloudImage,
        SNAPSHOT_V1 => return ArtifactKind::SnapshotV1,
        SNAPSHOT_V2 => return ArtifactKind::SnapshotV2,
        _ => {}
    }
    let config_type = doc
        .config
        .as_ref()
        .and_then(|c| c.media_type.as_deref())
        .unwrap_or("");
    if config_type == "application/vnd.oci.image.config.v1+json"
        || config_type == "application/vnd.docker.container.image.v1+json"
    {
        return ArtifactKind::ContainerImage;
    }
    let top = doc.media_type.as_deref().unwrap_or("");
    if top == INDEX_MEDIA_TYPE
        || top == DOCKER_LIST_MEDIA_TYPE
        || (top.is_empty() && doc.manifests.is_some())
    {
        return ArtifactKind::ImageIndex;
    }
    ArtifactKind::Unknown
}

/// Summary of a tag's manifest for the daemon (hibernate evidence, wake verification, run mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestInfo {
    pub kind: ArtifactKind,
    /// sha256 of the manifest bytes as served.
    pub digest: String,
    pub annotations: BTreeMap<String, String>,
    /// `snapshotId` from the config blob (snapshots only).
    pub snapshot_id: Option<String>,
    /// The parsed config blob (snapshots only).
    pub config: Option<SnapshotConfig>,
    /// The manifest's layers in order (snapshots only): what a copy of the snapshot's files
    /// from elsewhere (a peer) is checked against.
    pub layers: Vec<LayerRef>,
}

/// One layer descriptor of a snapshot manifest, as far as a file check needs it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerRef {
    /// `org.opencontainers.image.title`: the snapshot file the layer belongs to.
    pub title: String,
    /// `sha256:<hex>` of the blob.
    pub digest: String,
    pub size: u64,
    pub media_type: String,
}

impl ManifestInfo {
    pub fn base_image(&self) -> Option<&str> {
        self.annotations
            .get(BASEIMAGE)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }
    pub fn from_node(&self) -> Option<&str> {
        self.annotations
            .get(FROM_NODE)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }
    /// `cocoonstack.snapshot.owner-namespace`: the namespace the VM snapshot belongs to.
    pub fn owner_namespace(&self) -> Option<&str> {
        self.annotations
            .get(OWNER_NAMESPACE)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }
    /// `cocoonstack.snapshot.owner-pod-uid`: the pod that pushed it.
    pub fn owner_pod_uid(&self) -> Option<&str> {
        self.annotations
            .get(OWNER_POD_UID)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }
}

/// The owner annotations of a pushed VM snapshot (empty values are left out).
pub fn owner_annotations(namespace: &str, pod_uid: &str) -> BTreeMap<String, String> {
    [(OWNER_NAMESPACE, namespace), (OWNER_POD_UID, pod_uid)]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn is_zero_i64(v: &i64) -> bool {
    *v == 0
}
fn is_false(v: &bool) -> bool {
    !*v
}

/// Config blob, compact JSON in this field order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SnapshotConfig {
    pub schema_version: String,
    pub snapshot_id: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub description: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub image: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub image_digest: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub image_type: String,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub image_blob_ids: BTreeMap<String, serde_json::Value>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub hypervisor: String,
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub cpu: i64,
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub memory: i64,
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub storage: i64,
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub nics: i64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub network: String,
    #[serde(skip_serializing_if = "is_false")]
    pub windows: bool,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, SnapshotFile>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub created_at: String,
}

/// Per-file metadata in the config; all keys omitted when zero.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SnapshotFile {
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub mode: i64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub sparse_map: String,
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub sparse_size: i64,
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub size: i64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<String>,
}

/// Whether a layer title may name a file in the import archive: a plain relative name, no
/// `..`, no control characters (a NUL would cut the name short in the tar header), and not the
/// envelope's own name.
pub fn safe_layer_title(title: &str) -> bool {
    !title.is_empty()
        && !title.contains("..")
        && !title.starts_with('/')
        && title != "snapshot.json"
        && !title.chars().any(char::is_control)
}

/// The mode a snapshot file gets in the import archive: permission bits only (a registry's
/// setuid, setgid or sticky bits never reach the host); 0o640 when none are given.
pub fn import_mode(mode: i64) -> u32 {
    match (mode & 0o777) as u32 {
        0 => 0o640,
        m => m,
    }
}

/// Whether a config's `snapshotId` is a plain identifier (or absent): ASCII letters, digits,
/// `-`, `_`, `.`, not starting with `-` or `.`, at most 128 bytes.
pub fn valid_snapshot_id(id: &str) -> bool {
    id.is_empty()
        || (id.len() <= 128
            && !id.starts_with(['-', '.'])
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')))
}

/// Fills the config's cocoon fields from an export `snapshot.json` body.
pub fn config_from_envelope(body: &[u8]) -> Result<SnapshotConfig, TransferError> {
    let mut de = serde_json::Deserializer::from_slice(body).into_iter::<serde_json::Value>();
    let v = match de.next() {
        Some(Ok(v)) => v,
        Some(Err(e)) => return Err(TransferError::Format(format!("snapshot.json: {e}"))),
        None => return Err(TransferError::Format("snapshot.json is empty".into())),
    };
    let c = v.get("config").filter(|c| c.is_object()).ok_or_else(|| {
        TransferError::Format("snapshot.json: config must be a JSON object".into())
    })?;
    let s = |k: &str| c.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
    let n = |k: &str| c.get(k).and_then(|x| x.as_i64()).unwrap_or(0);
    let blob_ids = c
        .get("image_blob_ids")
        .and_then(|x| x.as_object())
        .map(|m| {
            m.keys()
                .map(|k| (k.clone(), serde_json::json!({})))
                .collect()
        })
        .unwrap_or_default();
    Ok(SnapshotConfig {
        snapshot_id: s("id"),
        description: s("description"),
        image: s("image"),
        image_digest: s("image_digest"),
        image_type: s("image_type"),
        image_blob_ids: blob_ids,
        hypervisor: s("hypervisor"),
        cpu: n("cpu"),
        memory: n("memory"),
        storage: n("storage"),
        nics: n("nics"),
        network: s("network"),
        windows: c.get("windows").and_then(|x| x.as_bool()).unwrap_or(false),
        ..Default::default()
    })
}

/// The import-side `snapshot.json`: version 1, keys in order, empties omitted except
/// `name`, 2-space indentation and a trailing newline.
pub fn envelope_for_import(cfg: &SnapshotConfig, local_name: &str) -> Vec<u8> {
    let mut m = serde_json::Map::new();
    let put_s = |m: &mut serde_json::Map<String, serde_json::Value>, k: &str, v: &str| {
        if !v.is_empty() {
            m.insert(k.into(), v.into());
        }
    };
    put_s(&mut m, "id", &cfg.snapshot_id);
    m.insert("name".into(), local_name.into());
    put_s(&mut m, "description", &cfg.description);
    put_s(&mut m, "image", &cfg.image);
    put_s(&mut m, "image_digest", &cfg.image_digest);
    put_s(&mut m, "image_type", &cfg.image_type);
    if !cfg.image_blob_ids.is_empty() {
        m.insert(
            "image_blob_ids".into(),
            serde_json::to_value(&cfg.image_blob_ids).unwrap_or_default(),
        );
    }
    put_s(&mut m, "hypervisor", &cfg.hypervisor);
    for (k, v) in [
        ("cpu", cfg.cpu),
        ("memory", cfg.memory),
        ("storage", cfg.storage),
        ("nics", cfg.nics),
    ] {
        if v != 0 {
            m.insert(k.into(), v.into());
        }
    }
    put_s(&mut m, "network", &cfg.network);
    if cfg.windows {
        m.insert("windows".into(), true.into());
    }
    // serde_json's map keeps insertion order only with preserve_order; emit by hand instead.
    let mut out = String::from("{\n  \"version\": 1,\n  \"config\": {");
    let ordered = [
        "id",
        "name",
        "description",
        "image",
        "image_digest",
        "image_type",
        "image_blob_ids",
        "hypervisor",
        "cpu",
        "memory",
        "storage",
        "nics",
        "network",
        "windows",
    ];
    let mut first = true;
    for k in ordered {
        if let Some(v) = m.get(k) {
            out.push_str(if first { "\n" } else { ",\n" });
            first = false;
            let val = serde_json::to_string_pretty(v)
                .unwrap_or_default()
                .replace('\n', "\n    ");
            out.push_str(&format!("    \"{k}\": {val}"));
        }
    }
    out.push_str("\n  }\n}\n");
    out.into_bytes()
}

/// One layer descriptor to publish.
#[derive(Debug, Clone)]
pub struct LayerDesc {
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    pub annotations: BTreeMap<String, String>,
}

fn descriptor(
    media_type: &str,
    digest: &str,
    size: u64,
    ann: &BTreeMap<String, String>,
) -> Result<Descriptor, TransferError> {
    let d: Digest = digest
        .parse()
        .map_err(|e| TransferError::Format(format!("bad digest {digest}: {e}")))?;
    let mut desc = Descriptor::new(MediaType::from(media_type), size, d);
    if !ann.is_empty() {
        desc.set_annotations(Some(
            ann.iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<HashMap<_, _>>(),
        ));
    }
    Ok(desc)
}

/// Builds the snapshot manifest as 2-space-indented JSON bytes.
pub fn build_manifest(
    v2: bool,
    config_digest: &str,
    config_size: u64,
    layers: &[LayerDesc],
    annotations: &BTreeMap<String, String>,
) -> Result<Vec<u8>, TransferError> {
    let cfg = descriptor(
        SNAPSHOT_CONFIG,
        config_digest,
        config_size,
        &BTreeMap::new(),
    )?;
    let layers = layers
        .iter()
        .map(|l| descriptor(&l.media_type, &l.digest, l.size, &l.annotations))
        .collect::<Result<Vec<_>, _>>()?;
    let manifest = ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .artifact_type(MediaType::from(if v2 { SNAPSHOT_V2 } else { SNAPSHOT_V1 }))
        .config(cfg)
        .layers(layers)
        .annotations(
            annotations
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<HashMap<_, _>>(),
        )
        .build()
        .map_err(|e| TransferError::Format(format!("build manifest: {e}")))?;
    // Re-serialise through a Value so map keys come out sorted like the Go writer's.
    let value =
        serde_json::to_value(&manifest).map_err(|e| TransferError::Format(e.to_string()))?;
    let ordered = order_manifest_keys(value);
    serde_json::to_vec_pretty(&ordered).map_err(|e| TransferError::Format(e.to_string()))
}

/// serde_json's Value map sorts keys; restore the struct order of the top level by emitting
/// a wrapper with the keys in the Go writer's order.
fn order_manifest_keys(v: serde_json::Value) -> OrderedManifest {
    let get = |k: &str| v.get(k).cloned();
    OrderedManifest {
        schema_version: get("schemaVersion"),
        media_type: get("mediaType"),
        artifact_type: get("artifactType"),
        config: get("config"),
        layers: get("layers"),
        annotations: get("annotations"),
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct OrderedManifest {
    schema_version: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    media_type: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    artifact_type: Option<serde_json::Value>,
    config: Option<serde_json::Value>,
    layers: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    annotations: Option<serde_json::Value>,
}

/// Parses a single-image manifest.
pub fn parse_manifest(body: &[u8], what: &str) -> Result<ImageManifest, TransferError> {
    serde_json::from_slice(body)
        .map_err(|e| TransferError::Format(format!("{what}: bad manifest: {e}")))
}

/// Parses an index and picks the child: first linux/amd64, else the first
/// platform whose architecture is not `unknown`.
pub fn pick_index_child(body: &[u8], what: &str) -> Result<String, TransferError> {
    let idx: ImageIndex = serde_json::from_slice(body)
        .map_err(|e| TransferError::Format(format!("{what}: bad index: {e}")))?;
    let ms = idx.manifests();
    let amd64 = ms.iter().find(|m| {
        m.platform().as_ref().is_some_and(|p| {
            p.os().to_string() == "linux" && p.architecture().to_string() == "amd64"
        })
    });
    let chosen = amd64.or_else(|| {
        let c = ms.iter().find(|m| {
            m.platform()
                .as_ref()
                .is_some_and(|p| p.architecture().to_string() != "unknown")
        });
        if c.is_some() {
            log::info!(
                "{what}: no linux/amd64 entry in the index, taking the first usable platform"
            );
        }
        c
    });
    chosen.map(|m| m.digest().to_string()).ok_or_else(|| {
        TransferError::Format(format!("{what}: image index has no usable platform entry"))
    })
}

/// RFC 3339 UTC with nanoseconds trimmed of trailing zeros.
pub use crate::rfc3339::nanos as rfc3339_nanos;
/// RFC 3339 UTC with seconds precision, e.g. `2026-08-11T07:12:33Z`.
pub use crate::rfc3339::seconds as rfc3339_seconds;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn media_types_by_name() {
        assert_eq!(
            media_type_for("config.json"),
            "application/vnd.cocoonstack.vm.config+json"
        );
        assert_eq!(
            media_type_for("memory-ranges"),
            "application/vnd.cocoonstack.vm.memory"
        );
        assert_eq!(
            media_type_for("overlay.qcow2"),
            "application/vnd.cocoonstack.disk.qcow2"
        );
        assert_eq!(
            media_type_for("data-x.raw"),
            "application/vnd.cocoonstack.disk.raw"
        );
        assert_eq!(media_type_for("cocoon.json"), "application/octet-stream");
    }

    #[test]
    fn classification() {
        let j = |s: &str| read_head(s.as_bytes(), "t").unwrap();
        assert_eq!(
            classify(&j(&format!(r#"{{"artifactType":"{OS_IMAGE}"}}"#))),
            ArtifactKind::CloudImage
        );
        assert_eq!(
            classify(&j(&format!(r#"{{"artifactType":"{SNAPSHOT_V2}"}}"#))),
            ArtifactKind::SnapshotV2
        );
        assert_eq!(
            classify(&j(
                r#"{"config":{"mediaType":"application/vnd.oci.image.config.v1+json"}}"#
            )),
            ArtifactKind::ContainerImage
        );
        assert_eq!(
            classify(&j(&format!(
                r#"{{"mediaType":"{INDEX_MEDIA_TYPE}","manifests":[]}}"#
            ))),
            ArtifactKind::ImageIndex
        );
        assert_eq!(
            classify(&j(r#"{"artifactType":"application/x"}"#)),
            ArtifactKind::Unknown
        );
    }

    #[test]
    fn config_json_shape() {
        let mut c = SnapshotConfig {
            schema_version: "v1".into(),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&c).unwrap(),
            r#"{"schemaVersion":"v1","snapshotId":""}"#
        );
        c.files.insert(
            "mem".into(),
            SnapshotFile {
                mode: 384,
                sparse_map: "[]".into(),
                sparse_size: 5,
                size: 3,
                chunks: vec![],
            },
        );
        c.cpu = 2;
        assert_eq!(
            serde_json::to_string(&c).unwrap(),
            r#"{"schemaVersion":"v1","snapshotId":"","cpu":2,"files":{"mem":{"mode":384,"sparseMap":"[]","sparseSize":5,"size":3}}}"#
        );
        let back: SnapshotConfig =
            serde_json::from_str(r#"{"schemaVersion":"v2","snapshotId":"x","unknown":1}"#).unwrap();
        assert_eq!(back.snapshot_id, "x");
    }

    #[test]
    fn envelope_round_trip() {
        let body = br#"{"version":1,"config":{"id":"S1","name":"vm","image":"img","cpu":2,"memory":4,"image_blob_ids":{"ab":{}},"queue_size":9}} trailing"#;
        let cfg = config_from_envelope(body).unwrap();
        assert_eq!(
            (cfg.snapshot_id.as_str(), cfg.cpu, cfg.memory),
            ("S1", 2, 4)
        );
        let out = envelope_for_import(&cfg, "local");
        let text = String::from_utf8(out).unwrap();
        assert!(text.ends_with("}\n"));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["version"], 1);
        assert_eq!(v["config"]["name"], "local");
        assert_eq!(v["config"]["id"], "S1");
        assert!(text.find("\"id\"").unwrap() < text.find("\"name\"").unwrap());
        assert!(config_from_envelope(br#"{"version":1,"config":null}"#).is_err());
    }

    #[test]
    fn times() {
        let t = UNIX_EPOCH + Duration::from_secs(1_786_432_353);
        assert_eq!(rfc3339_seconds(t), "2026-08-11T07:12:33Z");
        assert_eq!(
            rfc3339_nanos(t + Duration::from_nanos(481_516_920)),
            "2026-08-11T07:12:33.48151692Z"
        );
    }

    #[test]
    fn manifest_builds_and_parses() {
        let d = format!("sha256:{}", "1".repeat(64));
        let mut ann = BTreeMap::new();
        ann.insert(TITLE.to_string(), "config.json".to_string());
        let layers = vec![LayerDesc {
            media_type: media_type_for("config.json").into(),
            digest: d.clone(),
            size: 10,
            annotations: ann,
        }];
        let mut top = BTreeMap::new();
        top.insert(FROM_NODE.to_string(), "node-a".to_string());
        let bytes = build_manifest(false, &d, 5, &layers, &top).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.starts_with("{\n  \"schemaVersion\": 2,\n  \"mediaType\""));
        assert_eq!(
            classify(&read_head(&bytes, "t").unwrap()),
            ArtifactKind::SnapshotV1
        );
        let m = parse_manifest(&bytes, "t").unwrap();
        assert_eq!(m.layers().len(), 1);
    }

    #[test]
    fn layer_titles_modes_and_snapshot_ids_are_checked_before_the_import() {
        assert!(safe_layer_title("memory-ranges"));
        assert!(safe_layer_title("overlay.qcow2"));
        for bad in [
            "",
            "a\0b",
            "x\n",
            "../etc",
            "/abs",
            "snapshot.json",
            "a/../b",
        ] {
            assert!(!safe_layer_title(bad), "{bad:?}");
        }
        assert_eq!(import_mode(0o644), 0o644);
        assert_eq!(import_mode(0o4755), 0o755);
        assert_eq!(import_mode(0o2755), 0o755);
        assert_eq!(import_mode(0o1777), 0o777);
        assert_eq!(import_mode(0o4000), 0o640);
        assert_eq!(import_mode(0), 0o640);
        assert_eq!(import_mode(-1), 0o777);
        assert!(valid_snapshot_id(""));
        assert!(valid_snapshot_id("3f9a-b_c.1"));
        for bad in [
            "-rf",
            ".hidden",
            "a b",
            "a/b",
            "a\0",
            "x".repeat(129).as_str(),
        ] {
            assert!(!valid_snapshot_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_manifest_head_is_read_without_a_tree_and_overlong_lists_are_refused() {
        let body = r#"{"schemaVersion":2,"artifactType":null,"layers":[{"a":[1,{"b":2}]},{}],
            "annotations":{"k":"v","n":{"deep":[1,2,3]},"z":7}}"#;
        let head = read_head(body.as_bytes(), "t").unwrap();
        assert_eq!(head.layers, Some(Counted(2)));
        assert_eq!(
            head.string_annotations(),
            [("k".to_string(), "v".to_string())].into()
        );
        let many = format!(
            r#"{{"layers":[{}]}}"#,
            vec!["{}"; MAX_MANIFEST_ENTRIES + 1].join(",")
        );
        let err = read_head(many.as_bytes(), "t").unwrap_err();
        assert!(err.to_string().contains("entries"), "{err}");
        let children = format!(
            r#"{{"manifests":[{}]}}"#,
            vec!["{}"; MAX_MANIFEST_ENTRIES + 1].join(",")
        );
        assert!(read_head(children.as_bytes(), "t").is_err());
        assert!(read_head(b"[1]", "t").is_err());
    }
}
