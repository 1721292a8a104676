#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| forge_fuzz::targets::gguf(data));
