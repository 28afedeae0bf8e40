//! `include/collectives.h` is what cbindgen makes of `src/` today: CI fails
//! on a stale header. `COLL_BLESS=1 cargo test -p collectives-c --test
//! header` rewrites it.

use std::path::Path;

#[test]
fn the_checked_in_header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).unwrap();
    let mut fresh = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen reads capi/src")
        .write(&mut fresh);
    let path = dir.join("include/collectives.h");
    if std::env::var_os("COLL_BLESS").is_some() {
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == fresh,
        "capi/include/collectives.h differs from what cbindgen generates from capi/src; \
         regenerate it with COLL_BLESS=1 cargo test -p collectives-c --test header:\n{}",
        String::from_utf8_lossy(&fresh)
    );
}
