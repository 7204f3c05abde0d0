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
        snapshots: Vec<String>,
    },
    /// `refs/REV` names a commit whose snapshot directory is missing.
    NoSnapshot(PathBuf),
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
                match snapshots.as_slice() {
                    [] => write!(f, ", no snapshots)"),
                    s => write!(f, "; snapshots: {}; name one with @COMMIT)", s.join(", ")),
                }
            }
            Miss::NoSnapshot(p) => {
                write!(f, "{} (the commit its ref names is absent)", p.display())
            }
        }
    }
}

/// The snapshot directory of `org/name` at `rev` (default `main`) in `root`.
pub fn find_in(root: &Path, org: &str, name: &str, rev: Option<&str>) -> Result<PathBuf, Miss> {
    let repo = root.join(format!("models--{org}--{name}"));
    if !repo.is_dir() {
        return Err(Miss::NoRepo(repo));
    }
    let rev = rev.unwrap_or("main");
    let snapshots = repo.join("snapshots");
    let is_commit = rev.len() == 40 && rev.bytes().all(|b| b.is_ascii_hexdigit());
    if is_commit && snapshots.join(rev).is_dir() {
        return Ok(snapshots.join(rev));
    }
    // A ref file holds a 40-digit commit; anything else is not a ref huggingface_hub wrote.
    let commit = crate::fsutil::read_input_text(&repo.join("refs").join(rev), 256)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|c| c.len() == 40 && c.bytes().all(|b| b.is_ascii_hexdigit()));
    match commit {
        Some(c) if snapshots.join(&c).is_dir() => Ok(snapshots.join(c)),
        Some(c) => Err(Miss::NoSnapshot(snapshots.join(c))),
        None => {
            let mut names: Vec<String> = std::fs::read_dir(&snapshots)
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .filter(|e| e.path().is_dir())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            Err(Miss::NoRevision {
                repo,
                rev: rev.to_string(),
                snapshots: names,
            })
        }
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
                snapshots: vec![C1.into()]
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
