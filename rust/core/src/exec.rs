//! Where the core's data-parallel loops run.
//!
//! By default on rayon: the pool the caller installed, else the global one.
//! Inside [`on_this_thread`] they run on the calling thread alone, in order:
//! a one-thread call then pays no hand-off to a pool thread (waking it and
//! waiting for it cost about 0.05 ms per call on the development host, a
//! tenth of a small checkpoint's apply).

use std::cell::Cell;

use rayon::prelude::*;

thread_local! {
    static ON_THIS_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Run `f` with every data-parallel loop of the core on this thread.
pub fn on_this_thread<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ON_THIS_THREAD.set(self.0);
        }
    }
    let _restore = Restore(ON_THIS_THREAD.replace(true));
    f()
}

fn sequential() -> bool {
    ON_THIS_THREAD.get()
}

/// `f(0), f(1), ..., f(n - 1)`, in parallel unless inside [`on_this_thread`].
pub(crate) fn map_range<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync + Send) -> Vec<R> {
    if sequential() {
        (0..n).map(f).collect()
    } else {
        (0..n).into_par_iter().map(f).collect()
    }
}

/// `f(i, &mut items[i])` for every item, in parallel unless inside
/// [`on_this_thread`].
pub(crate) fn map_mut<T: Send, R: Send>(items: &mut [T], f: impl Fn(usize, &mut T) -> R + Sync + Send) -> Vec<R> {
    if sequential() {
        items.iter_mut().enumerate().map(|(i, x)| f(i, x)).collect()
    } else {
        items.par_iter_mut().enumerate().map(|(i, x)| f(i, x)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_this_thread_runs_every_loop_here_and_nests() {
        let here = std::thread::current().id();
        let threads = on_this_thread(|| map_range(64, |_| std::thread::current().id()));
        assert!(threads.iter().all(|&t| t == here));
        let mut items = vec![0usize; 64];
        let ids = on_this_thread(|| on_this_thread(|| map_mut(&mut items, |i, x| {
            *x = i;
            std::thread::current().id()
        })));
        assert!(ids.iter().all(|&t| t == here));
        assert_eq!(items, (0..64).collect::<Vec<_>>());
        assert!(!sequential(), "the flag is restored");
        // Outside, the loops run on a pool and give the same results.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        assert_eq!(pool.install(|| map_range(1000, |i| i * 2)), (0..1000).map(|i| i * 2).collect::<Vec<_>>());
    }
}
