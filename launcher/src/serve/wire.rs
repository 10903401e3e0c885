//! The server's socket (docs/serve.md, "The wire"): a Unix domain socket created with
//! owner-only permissions, frames of an 8-byte little-endian length and a JSON body, and
//! file descriptors passed beside a frame (`SCM_RIGHTS`).
//!
//! The socket's path is never a file this process did not create: an existing socket is
//! replaced only when nothing answers on it (a server that is gone left it), anything else
//! there is refused. The path is removed when the listener is dropped.

use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use serde_json::Value;

/// The largest frame either side sends: a batch of token ids as JSON is well below it.
pub const MAX_FRAME: u64 = 1 << 32;

/// The listening socket; its path is removed on drop.
pub struct Listener {
    inner: UnixListener,
    path: PathBuf,
}

impl Listener {
    /// Binds `path` with permissions 0600 (set through the umask, so that the socket is
    /// never reachable by others, not even between bind and chmod).
    pub fn bind(path: &Path) -> Result<Listener> {
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                bail!(
                    "--socket {}: a file that is not a socket is there; give another path",
                    path.display()
                );
            }
            if UnixStream::connect(path).is_ok() {
                bail!(
                    "--socket {}: a server is listening there already",
                    path.display()
                );
            }
            // A socket nobody answers on: left by a server that is gone.
            std::fs::remove_file(path)
                .with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
        let bound = UnixListener::bind(path);
        nix::sys::stat::umask(old);
        let inner = bound.with_context(|| format!("--socket {}: cannot listen", path.display()))?;
        let mode = std::fs::metadata(path)?.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            let _ = std::fs::remove_file(path);
            bail!(
                "--socket {}: created with mode {mode:o}, not owner-only",
                path.display()
            );
        }
        Ok(Listener {
            inner,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next client (blocking). The connection's reads and writes block too.
    pub fn accept(&self) -> Result<Conn> {
        let (stream, _) = self.inner.accept().context("accepting a client")?;
        Ok(Conn { stream })
    }

    /// Whether a client is waiting, within `timeout` (for a loop that also watches stop
    /// signals).
    pub fn wait(&self, timeout: std::time::Duration) -> Result<bool> {
        readable(self.inner.as_fd(), timeout)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether `fd` is readable within `timeout` (EINTR counts as not yet).
fn readable(fd: BorrowedFd, timeout: std::time::Duration) -> Result<bool> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    let ms =
        PollTimeout::try_from(timeout.as_millis().min(60_000) as i32).unwrap_or(PollTimeout::MAX);
    match poll(&mut fds, ms) {
        Ok(n) => Ok(n > 0),
        Err(nix::errno::Errno::EINTR) => Ok(false),
        Err(e) => Err(e).context("waiting on the socket"),
    }
}

/// One client's connection.
pub struct Conn {
    stream: UnixStream,
}

/// What a client sent.
pub enum Received {
    /// A request: a JSON object.
    Request(Value),
    /// A whole frame that is not a JSON object: the connection goes on.
    Malformed(String),
    /// The client closed the connection.
    Closed,
}

impl Conn {
    /// Whether a request (or the end of the connection) is waiting, within `timeout`.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<bool> {
        readable(self.stream.as_fd(), timeout)
    }

    /// The next request. An error (a frame cut short, one too large to read) leaves the
    /// connection unusable: its caller closes it.
    pub fn recv(&mut self) -> Result<Received> {
        let mut len = [0u8; 8];
        match self.stream.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(Received::Closed),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Ok(Received::Closed);
            }
            Err(e) => return Err(e).context("reading a request"),
        }
        let len = u64::from_le_bytes(len);
        if len > MAX_FRAME {
            bail!("a request of {len} bytes: the most a frame holds is {MAX_FRAME}");
        }
        let mut body = vec![0u8; len as usize];
        self.stream
            .read_exact(&mut body)
            .context("reading a request")?;
        Ok(match serde_json::from_slice::<Value>(&body) {
            Ok(v) if v.is_object() => Received::Request(v),
            Ok(_) => {
                Received::Malformed("a request is a JSON object naming its command in `cmd`".into())
            }
            Err(e) => Received::Malformed(format!(
                "a request that is not JSON ({e}); non-finite numbers are written as strings, \"NaN\""
            )),
        })
    }

    /// Sends `value` as one frame.
    pub fn send(&mut self, value: &Value) -> Result<()> {
        let body = serde_json::to_vec(value)?;
        let mut frame = (body.len() as u64).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        self.stream.write_all(&frame).context("answering")
    }

    /// Sends `value` as one frame with `fds` beside its first byte (`SCM_RIGHTS`).
    pub fn send_with_fds(&mut self, value: &Value, fds: &[BorrowedFd]) -> Result<()> {
        let body = serde_json::to_vec(value)?;
        let mut frame = (body.len() as u64).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let rights = [ControlMessage::ScmRights(&raw)];
        let sock = self.stream.as_raw_fd();
        // The descriptors ride with the first chunk; the rest of the frame follows.
        let sent = sendmsg::<()>(
            sock,
            &[IoSlice::new(&frame)],
            &rights,
            MsgFlags::empty(),
            None,
        )
        .context("answering with file descriptors")?;
        self.stream.write_all(&frame[sent..]).context("answering")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_socket(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mt-wire-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("s.sock")
    }

    fn client_frame(stream: &mut UnixStream, v: &Value) {
        let body = serde_json::to_vec(v).unwrap();
        stream
            .write_all(&(body.len() as u64).to_le_bytes())
            .unwrap();
        stream.write_all(&body).unwrap();
    }

    #[test]
    fn frames_round_trip_and_the_socket_is_owner_only() {
        let path = temp_socket("frames");
        let listener = Listener::bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let mut client = UnixStream::connect(&path).unwrap();
        let mut conn = listener.accept().unwrap();
        let req = serde_json::json!({"cmd": "info", "ids": [1, 2, 3]});
        client_frame(&mut client, &req);
        assert!(matches!(conn.recv().unwrap(), Received::Request(r) if r == req));
        let body = b"{\"cmd\": NaN}";
        client
            .write_all(&(body.len() as u64).to_le_bytes())
            .unwrap();
        client.write_all(body).unwrap();
        assert!(matches!(conn.recv().unwrap(), Received::Malformed(e) if e.contains("not JSON")));
        conn.send(&serde_json::json!({"ok": true})).unwrap();
        let mut len = [0u8; 8];
        client.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u64::from_le_bytes(len) as usize];
        client.read_exact(&mut body).unwrap();
        assert_eq!(body, br#"{"ok":true}"#);
        drop(client);
        assert!(
            matches!(conn.recv().unwrap(), Received::Closed),
            "a closed client ends the connection"
        );
        drop(listener);
        assert!(!path.exists(), "the socket is removed on drop");
    }

    #[test]
    fn an_existing_file_is_never_replaced_but_a_stale_socket_is() {
        let path = temp_socket("existing");
        std::fs::write(&path, b"not a socket").unwrap();
        let e = Listener::bind(&path).err().unwrap().to_string();
        assert!(e.contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
        std::fs::remove_file(&path).unwrap();
        // A live server's socket is refused; once it is gone, its leftover is replaced.
        {
            let _live = UnixListener::bind(&path).unwrap();
            let e = Listener::bind(&path).err().unwrap().to_string();
            assert!(e.contains("listening there already"), "{e}");
        }
        assert!(path.exists(), "std leaves the socket file behind");
        let again = Listener::bind(&path);
        assert!(again.is_ok(), "{:?}", again.err());
    }

    #[test]
    fn an_oversized_frame_is_refused() {
        let path = temp_socket("oversized");
        let listener = Listener::bind(&path).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        let mut conn = listener.accept().unwrap();
        client.write_all(&(MAX_FRAME + 1).to_le_bytes()).unwrap();
        let e = conn.recv().err().unwrap().to_string();
        assert!(e.contains("the most a frame holds"), "{e}");
    }
}
