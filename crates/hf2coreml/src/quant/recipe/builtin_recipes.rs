//! The recipes shipped in configs/recipes/, compiled in.

/// The embedded default recipe.
pub const DEFAULT_RECIPE: &str = include_str!("../../../../../configs/recipes/default.toml");
/// Recipes shipped in configs/recipes/, usable by name (`--recipe NAME`).
pub const BUILTIN_RECIPES: [(&str, &str); 7] = [
    ("default", DEFAULT_RECIPE),
    (
        "calibrated-4bit",
        include_str!("../../../../../configs/recipes/calibrated-4bit.toml"),
    ),
    (
        "data-free-4bit",
        include_str!("../../../../../configs/recipes/data-free-4bit.toml"),
    ),
    (
        "quality",
        include_str!("../../../../../configs/recipes/quality.toml"),
    ),
    (
        "compact",
        include_str!("../../../../../configs/recipes/compact.toml"),
    ),
    (
        "large-model",
        include_str!("../../../../../configs/recipes/large-model.toml"),
    ),
    (
        "ios18-4bit",
        include_str!("../../../../../configs/recipes/ios18-4bit.toml"),
    ),
];
