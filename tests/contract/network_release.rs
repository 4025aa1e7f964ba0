//! Lease release against a fake cocoon-net control server on a real Unix socket.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use vk_cocoon::network::release::{LeaseReleaser, ReleaseError};

/// Serve `answers` one connection each; send every request's head back to the test.
fn serve(listener: UnixListener, answers: Vec<Option<&'static str>>) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for answer in answers {
            let Ok((mut conn, _)) = listener.accept() else {
                return;
            };
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match conn.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let _ = tx.send(String::from_utf8_lossy(&req).into_owned());
            match answer {
                Some(a) => {
                    let _ = conn.write_all(a.as_bytes());
                }
                // Never answer: hold the connection until the client gives up.
                None => thread::sleep(Duration::from_secs(2)),
            }
        }
    });
    rx
}

#[test]
fn delete_request_shape_success_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("control.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let rx = serve(
        listener,
        vec![
            Some("HTTP/1.1 204 No Content\r\nDate: x\r\n\r\n"),
            Some("HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: 15\r\n\r\nno such lease\r\n"),
            Some("HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\n\r\ndisk full"),
            Some("garbage\r\n\r\n"),
            None,
        ],
    );
    let releaser = LeaseReleaser::new(Some(path.clone())).with_timeout(Duration::from_millis(300));

    releaser
        .release("02-00-0A-00-00-05")
        .expect("204 is success");
    let req = rx.recv().unwrap();
    assert!(
        req.starts_with("DELETE /v1/leases/02:00:0a:00:00:05 HTTP/1.1\r\n"),
        "{req}"
    );
    assert!(req.contains("\r\nHost: cocoon-net\r\n"), "{req}");

    match releaser.release("02:00:0a:00:00:06") {
        Err(ReleaseError::Status { code: 404, body }) => assert_eq!(body.trim(), "no such lease"),
        other => panic!("{other:?}"),
    }
    rx.recv().unwrap();
    match releaser.release("02:00:0a:00:00:07") {
        Err(ReleaseError::Status { code: 500, body }) => assert_eq!(body, "disk full"),
        other => panic!("{other:?}"),
    }
    rx.recv().unwrap();
    assert!(matches!(
        releaser.release("02:00:0a:00:00:08"),
        Err(ReleaseError::BadResponse(_))
    ));
    rx.recv().unwrap();

    // A server that never answers: the call gives up at its deadline.
    let t = Instant::now();
    match releaser.release("02:00:0a:00:00:09") {
        Err(ReleaseError::Io { error, .. }) => assert!(
            matches!(
                error.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "{error}"
        ),
        other => panic!("{other:?}"),
    }
    let took = t.elapsed();
    // Not before the 300 ms timeout; and it did time out (a loaded host only delays that).
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(20),
        "{took:?}"
    );
}

#[test]
fn missing_socket_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let releaser = LeaseReleaser::new(Some(dir.path().join("absent.sock")));
    let results = releaser.release_all(&["02:00:0a:00:00:05".to_string(), "bad".to_string()]);
    assert!(matches!(results[0].1, Err(ReleaseError::Io { .. })));
    assert!(matches!(results[1].1, Err(ReleaseError::InvalidMac(_))));
}
