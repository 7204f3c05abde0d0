//! A package's options: the OS it targets, the graph's layout, how the KV cache crosses the
//! package boundary and the prefill function's length. They say how the package is built, not
//! how its weights are quantized; a recipe file may set them beside its recipe
//! (`target = "ios18"`), and flags override them.

use super::contract::{KvCache, Layout, PrefillLogits, Target};

/// The largest `prefill_len` a recipe file may ask for (the package's S bounds it too).
pub const MAX_PREFILL_LEN: usize = 65_536;

/// How a package is built (the graph builder, the emitter and the contract read them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PackageOptions {
    /// `target = "ios17" | "ios18"` (`--target` overrides it).
    pub target: Target,
    /// `layout = "default" | "ane"` (`--layout` overrides it).
    pub layout: Layout,
    /// `kv_cache = "io" | "state"` (`--kv-cache` overrides it).
    pub kv_cache: KvCache,
    /// `prefill_len = Q` (`--prefill-len` overrides it): a `prefill` function of Q tokens
    /// beside `decode` (iOS18); `None`: the target's default, 0: one function.
    pub prefill_len: Option<usize>,
    /// `prefill_logits = "last" | "all"` (`--prefill-logits` overrides it): the rows the
    /// prefill function returns; `None`: the last one. Set with no prefill function: refused.
    pub prefill_logits: Option<PrefillLogits>,
}

impl PackageOptions {
    /// The keys a recipe file sets these options with.
    pub const KEYS: [&'static str; 5] = [
        "target",
        "layout",
        "kv_cache",
        "prefill_len",
        "prefill_logits",
    ];

    /// Set the option a recipe file's `key` names to `value`: `None` when `key` is not one of
    /// [`Self::KEYS`], else whether the value is one the key takes (the error says which are).
    pub fn set(&mut self, key: &str, value: &toml::Value) -> Option<Result<(), String>> {
        let set = match key {
            "target" => value
                .as_str()
                .and_then(Target::parse)
                .map(|t| self.target = t)
                .ok_or_else(|| "target must be \"ios17\", \"ios18\" or \"coreai\"".to_string()),
            "layout" => value
                .as_str()
                .and_then(Layout::parse)
                .map(|l| self.layout = l)
                .ok_or_else(|| "layout must be \"default\" or \"ane\"".to_string()),
            "kv_cache" => value
                .as_str()
                .and_then(KvCache::parse)
                .map(|k| self.kv_cache = k)
                .ok_or_else(|| "kv_cache must be \"io\" or \"state\"".to_string()),
            "prefill_len" => value
                .as_integer()
                .and_then(|q| usize::try_from(q).ok())
                .filter(|&q| q <= MAX_PREFILL_LEN)
                .map(|q| self.prefill_len = Some(q))
                .ok_or_else(|| format!("prefill_len must be an integer in 0..={MAX_PREFILL_LEN}")),
            "prefill_logits" => value
                .as_str()
                .and_then(PrefillLogits::parse)
                .map(|p| self.prefill_logits = Some(p))
                .ok_or_else(|| "prefill_logits must be \"last\" or \"all\"".to_string()),
            _ => return None,
        };
        Some(set)
    }

    /// The options as a recipe file's lines: each only when it is not the default, so that a
    /// recipe that sets none records the same text as one written before these options
    /// existed (its fingerprint stays).
    pub fn to_toml(&self) -> String {
        let mut out = match self.target {
            Target::Ios17 => String::new(),
            t => format!("target = \"{}\"\n", t.as_str()),
        };
        if self.layout != Layout::Default {
            out.push_str(&format!("layout = \"{}\"\n", self.layout.as_str()));
        }
        if self.kv_cache != KvCache::Io {
            out.push_str(&format!("kv_cache = \"{}\"\n", self.kv_cache.as_str()));
        }
        if let Some(q) = self.prefill_len {
            out.push_str(&format!("prefill_len = {q}\n"));
        }
        if let Some(p) = self.prefill_logits {
            out.push_str(&format!("prefill_logits = \"{}\"\n", p.as_str()));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `key` set to the TOML value `value` on the default options.
    fn set(key: &str, value: &str) -> Option<Result<PackageOptions, String>> {
        let table: toml::Table = format!("v = {value}").parse().unwrap();
        let mut p = PackageOptions::default();
        p.set(key, &table["v"]).map(|r| r.map(|()| p))
    }

    #[test]
    fn keys_set_their_option_and_refuse_other_values() {
        let p = set("target", "\"ios18\"").unwrap().unwrap();
        assert_eq!(p.target, Target::Ios18);
        assert_eq!(p.to_toml(), "target = \"ios18\"\n");
        let p = set("prefill_len", "32").unwrap().unwrap();
        assert_eq!(p.prefill_len, Some(32));
        assert!(set("layout", "\"ane\"").unwrap().is_ok());
        assert!(set("kv_cache", "\"state\"").unwrap().is_ok());
        assert_eq!(
            set("target", "\"coreai\"").unwrap().unwrap().target,
            Target::CoreAi
        );
        let refused = set("target", "\"ios19\"").unwrap().unwrap_err();
        for t in ["ios17", "ios18", "coreai"] {
            assert!(refused.contains(t), "{refused}");
        }
        assert!(set("prefill_len", "-1").unwrap().is_err());
        let p = set("prefill_logits", "\"all\"").unwrap().unwrap();
        assert_eq!(p.prefill_logits, Some(PrefillLogits::All));
        assert_eq!(p.to_toml(), "prefill_logits = \"all\"\n");
        assert!(set("prefill_logits", "\"first\"").unwrap().is_err());
        assert!(set("default", "\"fp16\"").is_none());
        assert_eq!(PackageOptions::default().to_toml(), "");
    }
}
