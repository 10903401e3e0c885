//! The C++ shims' (worker/src/kernels/backward.cpp, kernels/flash.cpp, profile.cpp) way of
//! failing: null, or the exception's text in a malloc'd C string.

use std::ffi::{CStr, c_char};

/// Ok for null; else the C++ side's error text, freed here.
pub fn checked(err: *mut c_char) -> anyhow::Result<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a NUL-terminated string from strdup, freed once here.
    let msg = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    unsafe { libc::free(err.cast()) };
    anyhow::bail!("{msg}")
}
