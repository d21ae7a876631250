//! Finds the system libfabric with pkg-config, compiles the C shim for its
//! static-inline calls and generates bindings with bindgen.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/wrapper.h");
    println!("cargo:rerun-if-changed=src/shim.h");
    println!("cargo:rerun-if-changed=src/shim.c");
    let lib = match pkg_config::Config::new()
        .atleast_version("1.17")
        .probe("libfabric")
    {
        Ok(lib) => lib,
        Err(e) => panic!(
            "libfabric >= 1.17 not found via pkg-config ({e}); install libfabric-dev (`make deps` does)"
        ),
    };
    let mut shim = cc::Build::new();
    shim.file("src/shim.c").warnings(true);
    for p in &lib.include_paths {
        shim.include(p);
    }
    shim.compile("dynamo_fabric_shim");

    let mut b = bindgen::Builder::default()
        .header("src/wrapper.h")
        .allowlist_function("fi_getinfo|fi_freeinfo|fi_dupinfo|fi_fabric|fi_strerror|dfi_.*")
        .allowlist_type("fi_.*|fid.*")
        .allowlist_var("FI_.*")
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for p in &lib.include_paths {
        b = b.clang_arg(format!("-I{}", p.display()));
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    b.generate()
        .expect("bindgen over the libfabric headers")
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings");
}
