//! What Envoy's HTTP connection manager does to `:path` before any filter sees it
//! (`ConnectionManagerUtility::maybeNormalizePath` in
//! `source/common/http/conn_manager_utility.cc`, with `source/common/http/path_utility.cc`):
//! escaped slashes per `path_with_escaped_slashes_action`, then RFC 3986 normalization
//! (`normalize_path`, Chromium's `url::CanonicalizePath`), then `merge_slashes`.

use super::config::{EscapedSlashesAction, HcmOptions};

/// What the connection manager does with the request after normalizing its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PathOutcome {
    /// Go on with this `:path`.
    Continue(String),
    /// 307 to this `:path` (UNESCAPE_AND_REDIRECT found an escaped slash).
    Redirect(String),
    /// 400, details `path_normalization_failed`.
    Reject,
}

/// `PathUtil::unescapeSlashes`: `%2F`/`%2f` → `/` and `%5C`/`%5c` → `\` in the path part;
/// `None` if there was none.
fn unescape_slashes(path: &str) -> Option<String> {
    let (path, query) = split_query(path);
    if !path.contains('%') {
        return None;
    }
    let mut out = String::with_capacity(path.len());
    let mut rest = path;
    let mut found = false;
    while let Some(at) = rest.find('%') {
        out.push_str(rest.get(..at).unwrap_or_default());
        let escape = rest.get(at..at + 3).unwrap_or_default();
        let replacement = match escape {
            "%2F" | "%2f" => Some('/'),
            "%5C" | "%5c" => Some('\\'),
            _ => None,
        };
        match replacement {
            Some(c) => {
                out.push(c);
                found = true;
                rest = rest.get(at + 3..).unwrap_or_default();
            }
            None => {
                out.push('%');
                rest = rest.get(at + 1..).unwrap_or_default();
            }
        }
    }
    out.push_str(rest);
    found.then(|| format!("{out}{query}"))
}

fn split_query(path: &str) -> (&str, &str) {
    match path.find('?') {
        Some(at) => (
            path.get(..at).unwrap_or_default(),
            path.get(at..).unwrap_or_default(),
        ),
        None => (path, ""),
    }
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Bytes Chromium's path canonicalizer escapes (controls, space, non-ASCII and the
/// characters URLs may not carry raw).
fn must_escape(b: u8) -> bool {
    b <= 0x20 || b >= 0x7f || matches!(b, b'"' | b'<' | b'>' | b'`' | b'{' | b'}')
}

fn hex(b: u8) -> Option<u8> {
    char::from(b)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
}

/// `PathUtil::canonicalPath`: decode escaped unreserved characters, escape what may not be
/// raw, treat `\` as `/`, resolve `.` and `..` segments. `None` (reject) on an escaped NUL,
/// as Chromium's canonicalizer fails on it.
pub(crate) fn canonical_path(original: &str) -> Option<String> {
    let (path, query) = split_query(original);
    let bytes = path.as_bytes();
    let mut text = String::with_capacity(path.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'\\' => text.push('/'),
            b'%' => match (
                bytes.get(i + 1).and_then(|h| hex(*h)),
                bytes.get(i + 2).and_then(|l| hex(*l)),
            ) {
                (Some(h), Some(l)) => {
                    let decoded = h * 16 + l;
                    if decoded == 0 {
                        return None;
                    }
                    if unreserved(decoded) {
                        text.push(char::from(decoded));
                    } else {
                        text.push_str(path.get(i..i + 3).unwrap_or_default());
                    }
                    i += 2;
                }
                _ => text.push('%'),
            },
            b if must_escape(b) => text.push_str(&format!("%{b:02X}")),
            b => text.push(char::from(b)),
        }
        i += 1;
    }
    Some(format!("{}{query}", remove_dot_segments(&text)))
}

/// RFC 3986 §5.2.4 on an absolute path (`..` above the root stays at the root).
fn remove_dot_segments(path: &str) -> String {
    let mut segments: Vec<&str> = Vec::new();
    let parts: Vec<&str> = path.strip_prefix('/').unwrap_or(path).split('/').collect();
    let last = parts.len().saturating_sub(1);
    for (n, segment) in parts.iter().enumerate() {
        match *segment {
            "." | ".." => {
                if *segment == ".." {
                    segments.pop();
                }
                if n == last {
                    segments.push("");
                }
            }
            s => segments.push(s),
        }
    }
    format!("/{}", segments.join("/"))
}

/// `PathUtil::mergeSlashes`: repeated slashes in the path part become one.
pub(crate) fn merge_slashes(original: &str) -> String {
    let (path, query) = split_query(original);
    if !path.contains("//") {
        return original.to_owned();
    }
    let prefix = if path.starts_with('/') { "/" } else { "" };
    let suffix = if path.ends_with('/') { "/" } else { "" };
    let joined: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let middle = joined.join("/");
    if middle.is_empty() {
        return format!("{prefix}{query}");
    }
    format!("{prefix}{middle}{suffix}{query}")
}

/// `ConnectionManagerUtility::maybeNormalizePath`.
pub(crate) fn normalize(path: &str, options: &HcmOptions) -> PathOutcome {
    let mut path = path.to_owned();
    let mut redirect = false;
    if options.escaped_slashes != EscapedSlashesAction::KeepUnchanged
        && let Some(unescaped) = unescape_slashes(&path)
    {
        match options.escaped_slashes {
            EscapedSlashesAction::RejectRequest => return PathOutcome::Reject,
            EscapedSlashesAction::UnescapeAndRedirect => redirect = true,
            EscapedSlashesAction::UnescapeAndForward | EscapedSlashesAction::KeepUnchanged => {}
        }
        path = unescaped;
    }
    if options.normalize_path {
        match canonical_path(&path) {
            Some(p) => path = p,
            None => return PathOutcome::Reject,
        }
    }
    if options.merge_slashes {
        path = merge_slashes(&path);
    }
    if redirect {
        PathOutcome::Redirect(path)
    } else {
        PathOutcome::Continue(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Cases from Envoy's `test/common/http/path_utility_test.cc`.
    #[test]
    fn canonical_path_as_envoy() {
        let cases = [
            ("/", "/"),
            ("//", "//"),
            ("/..", "/"),
            ("/../", "/"),
            ("/.", "/"),
            ("/./", "/"),
            ("/dir1/../dir2", "/dir2"),
            ("/dir1/./dir2", "/dir1/dir2"),
            ("/dir1/dir2/..", "/dir1/"),
            ("/dir1/%2e%2e/dir2", "/dir2"),
            ("/a/b/%2e%2e/c", "/a/c"),
            ("/dir1/%2E/dir2", "/dir1/dir2"),
            ("/%41%62%7e", "/Ab~"),
            ("/a%2Fb", "/a%2Fb"),
            ("/a\\b/../c", "/a/c"),
            ("/dir1/../dir2?q=/../x", "/dir2?q=/../x"),
            ("/a b", "/a%20b"),
        ];
        for (input, expected) in cases {
            assert_eq!(canonical_path(input).as_deref(), Some(expected), "{input}");
        }
        assert_eq!(canonical_path("/xyz/.%00../abc"), None);
        assert_eq!(canonical_path("/xyz/AAAAA%%0000/abc"), None);
    }

    #[test]
    fn merge_slashes_as_envoy() {
        for (input, expected) in [
            ("", ""),
            ("//", "/"),
            ("/a//b", "/a/b"),
            ("/a//b/", "/a/b/"),
            ("/a//b?c//d", "/a/b?c//d"),
            ("a//b", "a/b"),
        ] {
            assert_eq!(merge_slashes(input), expected, "{input}");
        }
    }

    #[test]
    fn unescape_slashes_as_envoy() {
        assert_eq!(unescape_slashes("%2f%2F").as_deref(), Some("//"));
        assert_eq!(unescape_slashes("/a%2Fb%2fc/").as_deref(), Some("/a/b/c/"));
        assert_eq!(unescape_slashes("/a%5cb%5C").as_deref(), Some("/a\\b\\"));
        assert_eq!(unescape_slashes("%2b"), None);
        assert_eq!(unescape_slashes("/a/b?c=%2F"), None);
    }
}
