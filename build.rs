// The emit bridge embeds CPython through pyo3. A shared libpython that lives outside the
// loader's default path (pyenv, conda, Homebrew) would make the binary fail to start, so the
// interpreter's LIBDIR goes into the binary's rpath.
fn main() {
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let out = std::process::Command::new(&python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')",
        ])
        .output();
    if let Ok(out) = out {
        let libdir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !libdir.is_empty() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
        }
    }
}
