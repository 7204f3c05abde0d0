//! Small pure helpers: byte and count formatting, sha256 as hex, and, from the numerics crate,
//! the deterministic random generator and the instruction-set level the vector kernels run at
//! ([`isa`]).

pub use hf2coreml_numerics::{isa, SplitMix64};

/// sha256 of bytes, as lowercase hex (a file's: [`crate::fsutil::sha256_file`]).
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Human-readable bytes (binary units): `1.50 GiB`.
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// A count with thousands separators: `134,515,008`.
pub fn fmt_count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The candidate closest to `name` by edit distance (insertions, deletions, substitutions and
/// swaps of neighbours), when it is close enough to be a typo: at most a third of the longer
/// name's characters, and at least 1.
pub fn nearest_name<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    candidates
        .into_iter()
        .map(|c| (edit_distance(name, c), c))
        .filter(|(d, c)| *d <= (name.chars().count().max(c.chars().count()) / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Optimal string alignment distance between `a` and `b`, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // rows[i][j]: the distance between a[..i] and b[..j].
    let mut rows = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in rows.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, d) in rows[0].iter_mut().enumerate() {
        *d = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut d = (rows[i - 1][j] + 1)
                .min(rows[i][j - 1] + 1)
                .min(rows[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d = d.min(rows[i - 2][j - 2] + 1);
            }
            rows[i][j] = d;
        }
    }
    rows[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_bytes() {
        assert_eq!(fmt_count(134_515_008), "134,515,008");
        assert_eq!(fmt_count(12), "12");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(fmt_bytes(10), "10 B");
    }

    #[test]
    fn nearest_name_catches_typos_not_strangers() {
        let names = [
            "default",
            "calibrated-4bit",
            "data-free-4bit",
            "quality",
            "compact",
        ];
        assert_eq!(nearest_name("defualt", names), Some("default"));
        assert_eq!(
            nearest_name("calibrated-4-bit", names),
            Some("calibrated-4bit")
        );
        assert_eq!(nearest_name("qualty", names), Some("quality"));
        assert_eq!(nearest_name("fp16", names), None);
        assert_eq!(nearest_name("", names), None);
        assert_eq!(edit_distance("ab", "ba"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
