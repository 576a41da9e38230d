//! The stand-in exports every NVML function of `nvml-functions.txt` (the whole
//! C API go-nvml binds, so NVIDIA's Go tools never die on an undefined
//! symbol), and the ones it does not simulate answer
//! `NVML_ERROR_FUNCTION_NOT_FOUND`.

use std::ffi::{CStr, c_char, c_uint};

const FUNCTION_NOT_FOUND: c_uint = 13;

fn listed() -> Vec<&'static str> {
    include_str!("../nvml-functions.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

#[test]
fn every_listed_function_resolves_and_stubs_answer_function_not_found() {
    let names = listed();
    assert_eq!(names.len(), 396, "nvml-functions.txt changed size");
    let path = gpu_stack_nvml::testing::standin_lib();
    // SAFETY: the stand-in's initialisers only set up Rust statics.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    let missing: Vec<&str> = names
        .iter()
        .copied()
        // SAFETY: only the address is looked up; nothing is called.
        .filter(|n| unsafe { lib.get::<*const ()>(n.as_bytes()) }.is_err())
        .collect();
    assert!(missing.is_empty(), "not exported: {missing:?}");

    // A vGPU query the simulator has no notion of: a stub. Stubs ignore their
    // arguments, so calling it without any is sound.
    // SAFETY: the stub's real signature is `fn() -> nvmlReturn_t`.
    let stub = unsafe {
        lib.get::<unsafe extern "C" fn() -> c_uint>(b"nvmlVgpuInstanceGetFbUsage")
            .unwrap()
    };
    // SAFETY: see above.
    assert_eq!(unsafe { stub() }, FUNCTION_NOT_FOUND);

    // SAFETY: `nvmlErrorString` has this signature and returns a static string.
    let error_string = unsafe {
        lib.get::<unsafe extern "C" fn(c_uint) -> *const c_char>(b"nvmlErrorString")
            .unwrap()
    };
    // SAFETY: the result is a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(error_string(FUNCTION_NOT_FOUND)) };
    assert_eq!(text.to_str().unwrap(), "Function Not Found");
    // SAFETY: as above.
    let text = unsafe { CStr::from_ptr(error_string(0)) };
    assert_eq!(text.to_str().unwrap(), "Success");
}
