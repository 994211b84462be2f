//! A bearer token kept in a file (a mounted Secret) and followed as the file changes.
//!
//! Kubernetes rotates a Secret volume by swapping a symlink, so the file's metadata changes; a
//! check that sees new metadata re-reads the file first. A presented token that does not match
//! also re-reads it, at most once per [`RELOAD_INTERVAL`], for file systems whose timestamps miss
//! a quick change. A file that is empty or unreadable later keeps the last good token (a Secret
//! being rewritten must not lock every operator out); at start it is an error naming the field.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use super::constant_time_eq;

/// How often a failed compare may re-read the file.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// Why a token file cannot be used at start.
#[derive(Debug, thiserror::Error)]
#[error("{field} {path}: {reason}")]
pub struct TokenFileError {
    /// The configuration field naming the file (e.g. `server.admin_token_file`).
    pub field: &'static str,
    /// The path.
    pub path: String,
    /// What is wrong with it.
    pub reason: String,
}

/// What identifies one version of the file on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
}

struct State {
    token: String,
    stamp: Option<Stamp>,
    last_forced: Option<Instant>,
    /// The last re-read failed (logged once until a read succeeds again).
    failing: bool,
}

/// A token read from a file, re-read when the file changes.
pub struct TokenFile {
    field: &'static str,
    path: PathBuf,
    state: Mutex<State>,
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenFile")
            .field("field", &self.field)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The file's token, trimmed of surrounding whitespace (a trailing newline is not part of it).
fn read(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let token = text.trim();
    if token.is_empty() {
        return Err("the file is empty".into());
    }
    Ok(token.to_owned())
}

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        modified: m.modified().ok(),
        len: m.len(),
    })
}

impl TokenFile {
    /// Reads the token once; an unreadable or empty file is an error naming `field` (I/O: one
    /// read).
    pub fn open(field: &'static str, path: &Path) -> Result<TokenFile, TokenFileError> {
        let stamp = stamp(path);
        let token = read(path).map_err(|reason| TokenFileError {
            field,
            path: path.display().to_string(),
            reason,
        })?;
        Ok(TokenFile {
            field,
            path: path.to_owned(),
            state: Mutex::new(State {
                token,
                stamp,
                last_forced: None,
                failing: false,
            }),
        })
    }

    /// Whether `presented` is the current token, compared in constant time. Costs one `stat` of
    /// the file, plus a read when it changed (or, on a mismatch, at most once per
    /// [`RELOAD_INTERVAL`]).
    pub fn matches(&self, presented: &str) -> bool {
        let mut s = self.state.lock();
        let now = stamp(&self.path);
        if now != s.stamp {
            s.stamp = now;
            self.reload(&mut s);
        }
        if constant_time_eq(presented.as_bytes(), s.token.as_bytes()) {
            return true;
        }
        if s.last_forced.is_some_and(|t| t.elapsed() < RELOAD_INTERVAL) {
            return false;
        }
        s.last_forced = Some(Instant::now());
        self.reload(&mut s);
        constant_time_eq(presented.as_bytes(), s.token.as_bytes())
    }

    fn reload(&self, s: &mut State) {
        match read(&self.path) {
            Ok(token) => {
                if token != s.token {
                    tracing::info!(field = self.field, path = %self.path.display(), "token file changed: the new token is in use");
                    s.token = token;
                }
                s.failing = false;
            }
            Err(reason) => {
                if !s.failing {
                    tracing::warn!(field = self.field, path = %self.path.display(), %reason, "token file unusable: keeping the last good token");
                }
                s.failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kv-epp-token-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("token")
    }

    /// Replaces the file the way a Secret volume does: a new file renamed over the old one.
    fn rotate(path: &Path, text: &str) {
        let next = path.with_extension("next");
        std::fs::write(&next, text).unwrap();
        std::fs::rename(&next, path).unwrap();
    }

    #[test]
    fn start_up_errors_name_the_field() {
        let path = temp("empty");
        std::fs::write(&path, " \n").unwrap();
        let e = TokenFile::open("server.admin_token_file", &path).unwrap_err();
        assert!(e.to_string().starts_with("server.admin_token_file "), "{e}");
        assert!(e.to_string().contains("empty"), "{e}");
        let e =
            TokenFile::open("server.metrics_token_file", Path::new("/nonexistent/t")).unwrap_err();
        assert!(
            e.to_string()
                .contains("server.metrics_token_file /nonexistent/t"),
            "{e}"
        );
    }

    #[test]
    fn follows_rotation_and_keeps_the_last_good_token() {
        let path = temp("rotate");
        std::fs::write(&path, "first\n").unwrap();
        let t = TokenFile::open("f", &path).unwrap();
        assert!(t.matches("first"));
        assert!(!t.matches("first\n") && !t.matches("firs") && !t.matches(""));
        rotate(&path, "second-token");
        assert!(
            t.matches("second-token"),
            "a changed file is re-read before comparing"
        );
        assert!(!t.matches("first"), "the old token stops working");
        // A momentarily empty file, then a missing one: the last good token stays.
        rotate(&path, "");
        assert!(t.matches("second-token"));
        std::fs::remove_file(&path).unwrap();
        assert!(t.matches("second-token"));
        rotate(&path, "third");
        assert!(t.matches("third"));
    }

    #[test]
    fn a_mismatch_rereads_at_most_once_per_interval() {
        let path = temp("interval");
        std::fs::write(&path, "aaaa").unwrap();
        let t = TokenFile::open("f", &path).unwrap();
        assert!(!t.matches("bbbb"), "a mismatch re-reads now");
        // Same length, and the stamp forced back to the old one: only a forced re-read can see
        // the change, and the last one was just now.
        std::fs::write(&path, "bbbb").unwrap();
        t.state.lock().stamp = stamp(&path);
        assert!(!t.matches("bbbb"));
        t.state.lock().last_forced = Some(Instant::now() - RELOAD_INTERVAL);
        assert!(t.matches("bbbb"));
    }
}
