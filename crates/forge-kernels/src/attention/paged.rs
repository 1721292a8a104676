//! Histories held in pages: a paged KV cache grows a page at a time, so its rows are not one
//! slice. Attention takes such a history run by run ([`Runs`]), a page being a run.

use super::{History, KvElem, RowScales, Runs};
use half::f16;

/// One scale per row, in pages of the history's page size (see [`RowScales`]).
#[derive(Clone, Copy, Debug, Default)]
pub enum PagedScales<'a> {
    #[default]
    None,
    F32(&'a [Box<[f32]>]),
    F16(&'a [Box<[f16]>]),
}

impl<'a> PagedScales<'a> {
    /// The scales of page `p` from its row `r0` on.
    fn at(&self, p: usize, r0: usize) -> RowScales<'a> {
        match *self {
            PagedScales::None => RowScales::None,
            PagedScales::F32(s) => RowScales::F32(&s[p][r0..]),
            PagedScales::F16(s) => RowScales::F16(&s[p][r0..]),
        }
    }
}

/// The first `n` rows of a history whose rows lie in pages of `page` rows each, `d` values a
/// row: row `j` is at `(j % page) · d` in page `j / page`, its scales (integer codes) at
/// `j % page` in the scale pages. `page` is a multiple of eight, so that every page starts a
/// block of eight keys: attention over the pages then gives the bits it gives over the same
/// rows in one slice.
#[derive(Clone, Copy, Debug)]
pub struct PagedHistory<'a, K, V> {
    pub keys: &'a [Box<[K]>],
    pub values: &'a [Box<[V]>],
    pub key_scales: PagedScales<'a>,
    pub value_scales: PagedScales<'a>,
    pub n: usize,
    pub d: usize,
    pub page: usize,
}

impl<'a, K: KvElem, V: KvElem> Runs<'a, K, V> for PagedHistory<'a, K, V> {
    fn rows(&self) -> usize {
        self.n
    }

    fn run(&self, j0: usize, j1: usize) -> History<'a, K, V> {
        assert!(self.page > 0 && self.page.is_multiple_of(8), "pages of {} rows (a multiple of 8)", self.page);
        let (p, r0) = (j0 / self.page, j0 % self.page);
        let end = j1.min(self.n).min((p + 1) * self.page);
        if end <= j0 {
            return History {
                keys: &[],
                values: &[],
                key_scales: RowScales::None,
                value_scales: RowScales::None,
                n: 0,
                stride: self.d,
                offset: 0,
            };
        }
        History {
            keys: &self.keys[p][r0 * self.d..],
            values: &self.values[p][r0 * self.d..],
            key_scales: self.key_scales.at(p, r0),
            value_scales: self.value_scales.at(p, r0),
            n: end - j0,
            stride: self.d,
            offset: 0,
        }
    }
}
