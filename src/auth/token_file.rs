//! Bearer tokens kept in a file (a mounted Secret) and followed as the file changes.
//!
//! The file holds one token per line (blank lines ignored, surrounding whitespace trimmed); every
//! token in it is accepted, and the first is the one this process presents when it dials (the
//! peer API). Two lines make a rotation possible without a moment where two processes disagree:
//! add the new token as a second line everywhere, then move it first, then drop the old one.
//!
//! Kubernetes rotates a Secret volume by swapping a symlink, so the file's metadata changes; a
//! check that sees new metadata re-reads the file first. A presented token that does not match
//! also re-reads it, at most once per [`RELOAD_INTERVAL`], for file systems whose timestamps miss
//! a quick change. A file that is empty or unreadable later keeps the last good tokens (a file
//! being rewritten in place must not lock every caller out); at start it is retried for a
//! moment ([`TokenFile::open_patiently`]), then an error naming the field. No token is ever
//! logged: messages name the field and the path only.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use super::constant_time_eq;

/// How often a failed compare may re-read the file.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// Most tokens one file may hold (a rotation needs two).
const MAX_TOKENS: usize = 8;

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
    tokens: Vec<String>,
    stamp: Option<Stamp>,
    last_forced: Option<Instant>,
    /// The last re-read failed (logged once until a read succeeds again).
    failing: bool,
}

/// Tokens read from a file, re-read when the file changes.
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

/// The file's tokens, one per non-blank line, trimmed (a trailing newline is not part of one).
fn read(path: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let tokens: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    if tokens.is_empty() {
        return Err("the file is empty".into());
    }
    if tokens.len() > MAX_TOKENS {
        return Err(format!("more than {MAX_TOKENS} tokens"));
    }
    if tokens
        .iter()
        .any(|t| !t.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Err("a token must be printable ASCII without spaces".into());
    }
    Ok(tokens)
}

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        modified: m.modified().ok(),
        len: m.len(),
    })
}

impl TokenFile {
    /// Reads the tokens once; an unreadable or empty file is an error naming `field` (I/O: one
    /// read).
    pub fn open(field: &'static str, path: &Path) -> Result<TokenFile, TokenFileError> {
        Self::open_patiently(field, path, Duration::ZERO)
    }

    /// As [`TokenFile::open`], retrying every 100 ms for up to `patience` while the file is
    /// missing, empty or unusable (a Secret being written by a tool that truncates first).
    /// Blocks the calling thread for at most `patience`.
    pub fn open_patiently(
        field: &'static str,
        path: &Path,
        patience: Duration,
    ) -> Result<TokenFile, TokenFileError> {
        let deadline = Instant::now() + patience;
        let tokens = loop {
            let stamp = stamp(path);
            match read(path) {
                Ok(tokens) => break (tokens, stamp),
                Err(reason) if Instant::now() >= deadline => {
                    return Err(TokenFileError {
                        field,
                        path: path.display().to_string(),
                        reason,
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        Ok(TokenFile {
            field,
            path: path.to_owned(),
            state: Mutex::new(State {
                tokens: tokens.0,
                stamp: tokens.1,
                last_forced: None,
                failing: false,
            }),
        })
    }

    /// Whether `presented` is one of the current tokens, compared in constant time (every
    /// token is compared). Costs one `stat` of the file, plus a read when it changed (or, on a
    /// mismatch, at most once per [`RELOAD_INTERVAL`]).
    pub fn matches(&self, presented: &str) -> bool {
        let mut s = self.state.lock();
        self.refresh_locked(&mut s);
        if any_eq(&s.tokens, presented) {
            return true;
        }
        if s.last_forced.is_some_and(|t| t.elapsed() < RELOAD_INTERVAL) {
            return false;
        }
        s.last_forced = Some(Instant::now());
        self.reload(&mut s);
        any_eq(&s.tokens, presented)
    }

    /// The token to present when dialling: the file's first. Costs one `stat`, plus a read when
    /// the file changed.
    pub fn current(&self) -> String {
        let mut s = self.state.lock();
        self.refresh_locked(&mut s);
        s.tokens[0].clone()
    }

    fn refresh_locked(&self, s: &mut State) {
        let now = stamp(&self.path);
        if now != s.stamp {
            s.stamp = now;
            self.reload(s);
        }
    }

    fn reload(&self, s: &mut State) {
        match read(&self.path) {
            Ok(tokens) => {
                if tokens != s.tokens {
                    tracing::info!(field = self.field, path = %self.path.display(), tokens = tokens.len(), "token file changed: the new tokens are in use");
                    s.tokens = tokens;
                }
                s.failing = false;
            }
            Err(reason) => {
                if !s.failing {
                    tracing::warn!(field = self.field, path = %self.path.display(), %reason, "token file unusable: keeping the last good tokens");
                }
                s.failing = true;
                // Read again at the next check even if the metadata does not move.
                s.stamp = None;
            }
        }
    }
}

fn any_eq(tokens: &[String], presented: &str) -> bool {
    tokens.iter().fold(false, |ok, t| {
        ok | constant_time_eq(presented.as_bytes(), t.as_bytes())
    })
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
        t.state.lock().failing = false;
        assert!(!t.matches("bbbb"));
        t.state.lock().last_forced = Some(Instant::now() - RELOAD_INTERVAL);
        assert!(t.matches("bbbb"));
    }

    #[test]
    fn every_line_is_accepted_and_the_first_is_presented() {
        let path = temp("two");
        std::fs::write(&path, "new-token\n\n  old-token \n").unwrap();
        let t = TokenFile::open("f", &path).unwrap();
        assert!(t.matches("new-token") && t.matches("old-token"));
        assert!(!t.matches("new-token\nold-token") && !t.matches(""));
        assert_eq!(t.current(), "new-token");
        rotate(&path, "old-token\n");
        assert_eq!(t.current(), "old-token");
        assert!(!t.matches("new-token"));
        std::fs::write(&path, "has space\n").unwrap();
        assert_eq!(
            t.current(),
            "old-token",
            "a bad file keeps the last good tokens"
        );
    }

    #[test]
    fn a_file_written_late_is_waited_for_at_start() {
        let path = temp("late");
        let _ = std::fs::remove_file(&path);
        let p2 = path.clone();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            rotate(&p2, "late-token\n");
        });
        let t = TokenFile::open_patiently("f", &path, Duration::from_secs(30)).unwrap();
        writer.join().unwrap();
        assert_eq!(t.current(), "late-token");
        assert!(
            TokenFile::open_patiently("f", Path::new("/nonexistent/t"), Duration::from_millis(200))
                .is_err()
        );
    }
}
