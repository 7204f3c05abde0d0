//! `hf2coreml recipes`: the shipped recipes, what each does and what it was measured to give.

use hf2coreml::quant::recipe::BUILTIN_RECIPES;
use hf2coreml::quant::Recipe;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print the list as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(serde::Serialize)]
struct Entry {
    name: &'static str,
    /// The projections' bits, the embedding's and the lm_head's storage, calibration.
    storage: String,
    about: String,
    measured: Option<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let entries = BUILTIN_RECIPES
        .iter()
        .map(|&(name, text)| {
            let recipe = Recipe::builtin(name).expect("a shipped recipe")?;
            Ok(Entry {
                name,
                storage: recipe.summary(),
                about: Recipe::about(text),
                measured: Recipe::measured(text),
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if args.json {
        return super::print_json(&serde_json::json!({
            "schema": "hf2coreml.recipes/1",
            "recipes": entries,
        }));
    }
    for e in &entries {
        println!("{:<16} {}", e.name, e.storage);
        print_wrapped(&e.about);
        if let Some(m) = &e.measured {
            print_wrapped(&format!("measured: {m}"));
        }
        println!();
    }
    println!("Use one with `--recipe NAME`, or write your own TOML file (README, \"Recipes\").");
    Ok(())
}

/// `text` in lines of at most 80 columns, indented under the name column.
fn print_wrapped(text: &str) {
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && 17 + line.len() + 1 + word.len() > 80 {
            println!("{:<16} {line}", "");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        println!("{:<16} {line}", "");
    }
}
