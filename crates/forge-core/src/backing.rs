//! The bytes of an opened file: a memory map, or a buffer handed in by the caller (tests and
//! fuzzing parse from memory through the same readers).

use memmap2::Mmap;

#[derive(Debug)]
pub(crate) enum Backing {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
        }
    }
}
