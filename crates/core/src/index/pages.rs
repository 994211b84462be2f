//! Fresh tables written before they are read.
//!
//! Memory fresh from the kernel (`mmap`, or the heap's new top, which `calloc` does not clear)
//! reads as the shared zero page until written. A table that is read before it is written (a
//! probe finds its slot empty, then fills it) would fault twice per page, and the second fault
//! replaces a mapping that every core running the process may have cached: a TLB shootdown, an
//! interrupt on every other core, under whatever query or request runs there. Writing one byte
//! per page first makes each page's only fault a write fault, which replaces nothing.

/// Writes a zero byte into every page of the zeroed `bytes` at `p`. Volatile, so the compiler
/// cannot fold the writes into the allocation (it turns an allocation followed by zeroing into
/// `calloc`, which leaves fresh pages unwritten).
///
/// # Safety
/// `p..p + bytes` must be writable, zero, and not yet seen by another thread.
pub(super) unsafe fn fault_in(p: *mut u8, bytes: usize) {
    const PAGE: usize = 4096;
    for off in (0..bytes).step_by(PAGE).chain(bytes.checked_sub(1)) {
        // SAFETY: in bounds (the caller's range); the byte is already 0.
        unsafe { p.add(off).write_volatile(0) };
    }
}

/// `n` all-zero `T`s, every page written ([`fault_in`]).
///
/// # Safety
/// The all-zero bit pattern must be a valid `T`.
pub(super) unsafe fn zeroed<T>(n: usize) -> Box<[T]> {
    let layout = std::alloc::Layout::array::<T>(n).expect("table size");
    if layout.size() == 0 {
        return Vec::new().into_boxed_slice();
    }
    // SAFETY: non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    // SAFETY: the allocation's own bytes, zeroed and not yet shared; then, a global allocation
    // of `[T; n]`'s layout holding all-zero `T`s, valid by the caller's promise.
    unsafe {
        fault_in(p, layout.size());
        Box::from_raw(std::ptr::slice_from_raw_parts_mut(p.cast::<T>(), n))
    }
}

/// Pages of `start..start + bytes` not yet written by this process: absent, or mapped to a page
/// shared with others (the zero page), from `/proc/self/pagemap` (bit 63: present; bit 56:
/// exclusively mapped, which the zero page never is).
#[cfg(all(test, target_os = "linux"))]
#[expect(
    clippy::disallowed_types,
    reason = "tests read the kernel's page map; the core's code still does no I/O"
)]
pub(super) fn unwritten_pages(start: usize, bytes: usize) -> usize {
    use std::io::{Read, Seek, SeekFrom};
    let mut pagemap = std::fs::File::open("/proc/self/pagemap").expect("pagemap");
    let mut missing = 0;
    for page in (start / 4096)..(start + bytes).div_ceil(4096) {
        let mut entry = [0u8; 8];
        pagemap
            .seek(SeekFrom::Start(page as u64 * 8))
            .and_then(|_| pagemap.read_exact(&mut entry))
            .expect("pagemap entry");
        let e = u64::from_le_bytes(entry);
        if e >> 63 == 0 || (e >> 56) & 1 == 0 {
            missing += 1;
        }
    }
    missing
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    /// A table from [`super::zeroed`] large enough to be mapped fresh (a worker map of a few
    /// hundred thousand blocks) has every page written, and is all zero.
    #[test]
    fn a_zeroed_table_is_faulted_in_by_writes() {
        let bytes = 8 << 20;
        // SAFETY: any byte is a valid u8.
        let table = unsafe { super::zeroed::<u8>(bytes) };
        assert_eq!(super::unwritten_pages(table.as_ptr() as usize, bytes), 0);
        assert!(table.iter().all(|&b| b == 0));
        // SAFETY: as above; an empty table allocates nothing.
        assert!(unsafe { super::zeroed::<u8>(0) }.is_empty());
    }
}
