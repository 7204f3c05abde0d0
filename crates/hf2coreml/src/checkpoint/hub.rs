//! Hugging Face Hub ids resolved offline through the local Hub cache.
//!
//! A model downloaded with `hf download`, `huggingface-cli` or transformers lives under
//! `CACHE/models--ORG--NAME/`: `refs/REV` holds the commit a branch or tag points at,
//! `snapshots/COMMIT/` holds the files (symlinks into `blobs/`). `ORG/NAME[@REV]` names the
//! snapshot of `REV` (default `main`) in the first cache that has one; hf2coreml never downloads.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// `ORG/NAME` or `ORG/NAME@REV` split into the repository and the revision, when `arg` is
/// spelled as a Hub id (the characters the Hub allows, no part starting with a dot).
pub fn parse_id(arg: &str) -> Option<(&str, &str, Option<&str>)> {
    let (repo, rev) = match arg.split_once('@') {
        Some((repo, rev)) => (repo, Some(rev)),
        None => (arg, None),
    };
    let part = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.len() <= 96
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    let (org, name) = repo.split_once('/')?;
    let rev_ok = rev.is_none_or(|r| r.split('/').all(part));
    (part(org) && part(name) && rev_ok).then_some((org, name, rev))
}

/// The command that puts `id` into the Hub cache (for messages).
pub fn download_command(id: &str) -> String {
    match id.split_once('@') {
        Some((repo, rev)) => format!("hf download {repo} --revision {rev}"),
        None => format!("hf download {id}"),
    }
}

/// The Hub caches to look in, in the order huggingface_hub consults them: `HF_HUB_CACHE`,
/// `HF_HOME/hub`, `XDG_CACHE_HOME/huggingface/hub`, `~/.cache/huggingface/hub` (each once).
pub fn cache_roots() -> Vec<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    roots_from(
        var("HF_HUB_CACHE"),
        var("HF_HOME"),
        var("XDG_CACHE_HOME"),
        var("HOME"),
    )
}

fn roots_from(
    hub_cache: Option<OsString>,
    hf_home: Option<OsString>,
    xdg: Option<OsString>,
    home: Option<OsString>,
) -> Vec<PathBuf> {
    let candidates = [
        hub_cache.map(PathBuf::from),
        hf_home.map(|h| PathBuf::from(h).join("hub")),
        xdg.map(|x| PathBuf::from(x).join("huggingface").join("hub")),
        home.map(|h| {
            PathBuf::from(h)
                .join(".cache")
                .join("huggingface")
                .join("hub")
        }),
    ];
    let mut roots: Vec<PathBuf> = Vec::new();
    for c in candidates.into_iter().flatten() {
        if !roots.contains(&c) {
            roots.push(c);
        }
    }
    roots
}

/// Why an id found no snapshot in one cache (for the message naming every place looked).
#[derive(Debug, Clone, PartialEq)]
pub enum Miss {
    /// No `models--ORG--NAME` directory.
    NoRepo(PathBuf),
    /// The repository is there but `refs/REV` is not, and REV is no snapshot's commit.
    NoRevision {
        repo: PathBuf,
        rev: String,
        snapshots: Listing,
    },
    /// `refs/REV` names a commit whose snapshot directory is missing.
    NoSnapshot(PathBuf),
    /// A path of the cache is there but is not what huggingface_hub writes (a ref that is no
    /// regular file or holds no commit, a snapshot or repository that is no directory, a
    /// symlink loop): `why` says what it is instead.
    Broken { path: PathBuf, why: String },
}

/// Most names a message lists from one directory: a cache with 30,000 snapshots makes a
/// message of a few lines, not of a megabyte.
pub const MAX_LISTED: usize = 5;

/// The first [`MAX_LISTED`] names of a directory's entries, in order, and how many there are.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Listing {
    pub first: Vec<String>,
    pub total: usize,
}

impl Listing {
    /// The names of the directories in `dir` (none when it cannot be read), each escaped so
    /// that control characters in a name cannot reach the terminal.
    fn directories(dir: &Path) -> Self {
        let mut first: Vec<String> = Vec::new();
        let mut total = 0;
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if !e.path().is_dir() {
                continue;
            }
            total += 1;
            let name = e.file_name().to_string_lossy().escape_debug().to_string();
            // Keep the smallest names only: memory stays bounded however many there are.
            let at = first.partition_point(|n| *n < name);
            if at < MAX_LISTED {
                first.insert(at, name);
                first.truncate(MAX_LISTED);
            }
        }
        Listing { first, total }
    }
}

impl std::fmt::Display for Listing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.first.join(", "))?;
        match self.total.saturating_sub(self.first.len()) {
            0 => Ok(()),
            more => write!(f, " and {more} more"),
        }
    }
}

impl std::fmt::Display for Miss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Miss::NoRepo(p) => write!(f, "{} (absent)", p.display()),
            Miss::NoRevision {
                repo,
                rev,
                snapshots,
            } => {
                write!(f, "{} (no refs/{rev}", repo.display())?;
                match snapshots.total {
                    0 => write!(f, ", no snapshots)"),
                    _ => write!(f, "; snapshots: {snapshots}; name one with @COMMIT)"),
                }
            }
            Miss::NoSnapshot(p) => {
                write!(f, "{} (the commit its ref names is absent)", p.display())
            }
            Miss::Broken { path, why } => write!(f, "{} ({why})", path.display()),
        }
    }
}

/// What `path` is when it is not a directory, or `None` when it is one or is absent (a
/// dangling symlink counts as absent: its target never arrived).
fn not_a_directory(path: &Path) -> Option<String> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => None,
        Ok(m) => Some(format!("{}, not a directory", file_kind(&m))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => Some(cannot_look(&e)),
    }
}

/// What a path that cannot be looked at is: a symlink loop, or the system's reason.
fn cannot_look(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ELOOP) => "a symlink loop".into(),
        _ => format!("cannot be looked at: {e}"),
    }
}

fn file_kind(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    match () {
        _ if t.is_dir() => "a directory",
        _ if t.is_file() => "a regular file",
        _ if t.is_fifo() => "a FIFO",
        _ if t.is_char_device() => "a character device",
        _ if t.is_block_device() => "a block device",
        _ if t.is_socket() => "a socket",
        _ => "not a regular file",
    }
}

/// The commit `refs/REV` names: `Ok(None)` when there is no such file, `Err(why)` when there
/// is one that is not a ref huggingface_hub wrote (a ref file holds a 40-digit commit).
fn read_ref(file: &Path) -> Result<Option<String>, String> {
    match std::fs::metadata(file) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(cannot_look(&e)),
        Ok(m) if !m.is_file() => {
            return Err(format!(
                "{}, not a regular file: a ref is a file holding a commit",
                file_kind(&m)
            ))
        }
        Ok(_) => {}
    }
    let text = crate::fsutil::read_input_text(file, 256).map_err(|e| e.to_string())?;
    let c = text.trim();
    let shown = || {
        let mut s: String = c
            .chars()
            .take(48)
            .collect::<String>()
            .escape_debug()
            .to_string();
        if c.chars().count() > 48 {
            s.push('…');
        }
        s
    };
    if c.is_empty() {
        return Err("empty: a ref holds a commit (40 hex digits)".into());
    }
    if c.contains("..") || c.contains('/') || c.contains('\\') {
        return Err(format!(
            "holds `{}`, a path: a ref holds a commit (40 hex digits), never a path",
            shown()
        ));
    }
    if !(c.len() == 40 && c.bytes().all(|b| b.is_ascii_hexdigit())) {
        return Err(format!("holds `{}`, not a commit (40 hex digits)", shown()));
    }
    Ok(Some(c.to_string()))
}

/// The snapshot directory of `org/name` at `rev` (default `main`) in `root`.
pub fn find_in(root: &Path, org: &str, name: &str, rev: Option<&str>) -> Result<PathBuf, Miss> {
    let repo = root.join(format!("models--{org}--{name}"));
    let broken = |path: PathBuf, why: String| Miss::Broken { path, why };
    if let Some(why) = not_a_directory(&repo) {
        return Err(broken(repo, why));
    }
    if !repo.is_dir() {
        return Err(Miss::NoRepo(repo));
    }
    let rev = rev.unwrap_or("main");
    let snapshots = repo.join("snapshots");
    if let Some(why) = not_a_directory(&snapshots) {
        return Err(broken(snapshots, why));
    }
    let is_commit = rev.len() == 40 && rev.bytes().all(|b| b.is_ascii_hexdigit());
    if is_commit {
        let snap = snapshots.join(rev);
        if let Some(why) = not_a_directory(&snap) {
            return Err(broken(snap, why));
        }
        if snap.is_dir() {
            return Ok(snap);
        }
    }
    let ref_file = repo.join("refs").join(rev);
    match read_ref(&ref_file) {
        Err(why) => Err(broken(ref_file, why)),
        Ok(Some(c)) => {
            let snap = snapshots.join(c);
            match not_a_directory(&snap) {
                Some(why) => Err(broken(snap, why)),
                None if snap.is_dir() => Ok(snap),
                None => Err(Miss::NoSnapshot(snap)),
            }
        }
        Ok(None) => Err(Miss::NoRevision {
            repo,
            rev: rev.to_string(),
            snapshots: Listing::directories(&snapshots),
        }),
    }
}

/// The snapshot `id` names in the first of `roots` that holds it, or every place looked.
pub fn resolve_in(roots: &[PathBuf], id: &str) -> Option<Result<PathBuf, Vec<Miss>>> {
    let (org, name, rev) = parse_id(id)?;
    let mut misses = Vec::new();
    for root in roots {
        match find_in(root, org, name, rev) {
            Ok(dir) => return Some(Ok(dir)),
            Err(m) => misses.push(m),
        }
    }
    Some(Err(misses))
}

#[cfg(test)]
mod tests {
    use super::*;

    const C1: &str = "0123456789abcdef0123456789abcdef01234567";
    const C2: &str = "89abcdef0123456789abcdef0123456789abcdef";

    fn repo(root: &Path, refs: &[(&str, &str)], snapshots: &[&str]) -> PathBuf {
        let repo = root.join("models--Org--Model-1.5B");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        for (r, c) in refs {
            let p = repo.join("refs").join(r);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, c).unwrap();
        }
        for s in snapshots {
            std::fs::create_dir_all(repo.join("snapshots").join(s)).unwrap();
        }
        repo
    }

    #[test]
    fn ids_are_spelled_as_the_hub_spells_them() {
        assert_eq!(parse_id("Org/Model"), Some(("Org", "Model", None)));
        assert_eq!(
            parse_id("Org/Model-1.5B@v1.0"),
            Some(("Org", "Model-1.5B", Some("v1.0")))
        );
        assert_eq!(
            parse_id("Org/M@refs/pr/3"),
            Some(("Org", "M", Some("refs/pr/3")))
        );
        for bad in [
            "model",
            "a/b/c",
            "./x",
            "Org/.hidden",
            "Org/M@",
            "Org/M@../x",
            "/abs/path",
            "Org/",
            "Org/M y",
        ] {
            assert_eq!(parse_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_ref_names_its_snapshot_and_a_commit_names_itself() {
        let t = tempfile::tempdir().unwrap();
        let r = repo(
            t.path(),
            &[("main", C1), ("v2", &format!("{C2}\n"))],
            &[C1, C2],
        );
        let snap = |c: &str| r.join("snapshots").join(c);
        assert_eq!(find_in(t.path(), "Org", "Model-1.5B", None), Ok(snap(C1)));
        assert_eq!(
            find_in(t.path(), "Org", "Model-1.5B", Some("v2")),
            Ok(snap(C2))
        );
        assert_eq!(
            find_in(t.path(), "Org", "Model-1.5B", Some(C2)),
            Ok(snap(C2))
        );
        assert_eq!(
            find_in(t.path(), "Org", "Other", None),
            Err(Miss::NoRepo(t.path().join("models--Org--Other")))
        );
    }

    #[test]
    fn a_missing_ref_lists_the_snapshots_there_are() {
        let t = tempfile::tempdir().unwrap();
        let r = repo(t.path(), &[("v2", C2)], &[C1]);
        let miss = find_in(t.path(), "Org", "Model-1.5B", None).unwrap_err();
        assert_eq!(
            miss,
            Miss::NoRevision {
                repo: r.clone(),
                rev: "main".into(),
                snapshots: Listing {
                    first: vec![C1.into()],
                    total: 1
                }
            }
        );
        assert!(miss.to_string().contains("@COMMIT"), "{miss}");
        // A ref pointing at a commit that is not there is said so.
        assert_eq!(
            find_in(t.path(), "Org", "Model-1.5B", Some("v2")),
            Err(Miss::NoSnapshot(r.join("snapshots").join(C2)))
        );
    }

    #[test]
    fn a_ref_or_snapshot_that_is_there_but_broken_says_what_it_is() {
        let t = tempfile::tempdir().unwrap();
        let r = repo(t.path(), &[("main", "")], &[C1]);
        let why = |rev: Option<&str>| match find_in(t.path(), "Org", "Model-1.5B", rev) {
            Err(Miss::Broken { path, why }) => (path, why),
            other => panic!("{other:?}"),
        };
        let main = r.join("refs/main");
        assert_eq!(why(None), (main.clone(), why(None).1));
        assert!(why(None).1.starts_with("empty"), "{}", why(None).1);
        std::fs::write(&main, "../snapshots").unwrap();
        assert!(why(None).1.contains("a path"), "{}", why(None).1);
        std::fs::remove_file(&main).unwrap();
        std::fs::create_dir(&main).unwrap();
        assert!(why(None).1.starts_with("a directory"), "{}", why(None).1);
        let snap = r.join("snapshots").join(C1);
        std::fs::remove_dir(&snap).unwrap();
        std::os::unix::fs::symlink(C1, &snap).unwrap();
        assert_eq!(why(Some(C1)), (snap, "a symlink loop".to_string()));
    }

    #[test]
    fn listings_keep_the_first_names_and_count_the_rest() {
        let t = tempfile::tempdir().unwrap();
        for i in (0..12).rev() {
            std::fs::create_dir(t.path().join(format!("s{i:02}"))).unwrap();
        }
        std::fs::write(t.path().join("a-file"), b"").unwrap();
        let l = Listing::directories(t.path());
        assert_eq!(l.first, ["s00", "s01", "s02", "s03", "s04"]);
        assert_eq!(l.total, 12);
        assert_eq!(l.to_string(), "s00, s01, s02, s03, s04 and 7 more");
        let l = Listing::directories(&t.path().join("absent"));
        assert_eq!((l.to_string(), l.total), (String::new(), 0));
    }

    #[test]
    fn the_first_cache_holding_the_id_wins_and_every_miss_is_kept() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let r = repo(b.path(), &[("main", C1)], &[C1]);
        let roots = [a.path().to_path_buf(), b.path().to_path_buf()];
        assert_eq!(
            resolve_in(&roots, "Org/Model-1.5B"),
            Some(Ok(r.join("snapshots").join(C1)))
        );
        let Some(Err(misses)) = resolve_in(&roots, "Org/Absent") else {
            panic!("found");
        };
        assert_eq!(misses.len(), 2);
        assert_eq!(resolve_in(&roots, "not an id"), None);
    }

    #[test]
    fn cache_roots_follow_huggingface_hubs_precedence() {
        let s = |x: &str| Some(OsString::from(x));
        assert_eq!(
            roots_from(s("/hc"), s("/hh"), s("/x"), s("/h")),
            [
                "/hc",
                "/hh/hub",
                "/x/huggingface/hub",
                "/h/.cache/huggingface/hub"
            ]
            .map(PathBuf::from)
        );
        assert_eq!(
            roots_from(None, None, s("/h/.cache"), s("/h")),
            [PathBuf::from("/h/.cache/huggingface/hub")]
        );
    }
}
