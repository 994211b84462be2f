//! The objects one watch has seen, kept by name, and the retry pacing shared by every watch loop.
//!
//! kube-rs's watcher announces each (re)list with `Init`, streams the listed objects, and closes
//! with `InitDone`; objects missing from a relist were deleted while the watch was away, so the
//! listed set *replaces* the store at `InitDone` (that is what makes a 410 Gone → relist exact).

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use kube::api::{Api, DynamicObject};
use kube::runtime::watcher::{self, Event};

/// A boxed watch of dynamic objects.
pub(super) type Watch = BoxStream<'static, Result<Event<DynamicObject>, watcher::Error>>;

/// Starts a kube-rs watcher (nothing is requested before the first poll).
pub(super) fn watch(api: Api<DynamicObject>, config: watcher::Config) -> Watch {
    watcher::watcher(api, config).boxed()
}

/// The objects of one watch by name.
#[derive(Default)]
pub(super) struct Store {
    objects: BTreeMap<String, DynamicObject>,
    listing: Option<BTreeMap<String, DynamicObject>>,
    listed: bool,
}

impl Store {
    /// Applies one watch event; true when the complete view changed (a list completed, or an
    /// object was added, modified or deleted after it).
    pub(super) fn apply(&mut self, event: Event<DynamicObject>) -> bool {
        match event {
            Event::Init => {
                self.listing = Some(BTreeMap::new());
                false
            }
            Event::InitApply(o) => {
                if let Some(l) = &mut self.listing {
                    l.insert(name(&o), o);
                }
                false
            }
            Event::InitDone => {
                self.objects = self.listing.take().unwrap_or_default();
                self.listed = true;
                true
            }
            Event::Apply(o) => {
                self.objects.insert(name(&o), o);
                true
            }
            Event::Delete(o) => {
                self.objects.remove(&name(&o));
                true
            }
        }
    }

    /// Whether a complete list has been seen.
    pub(super) fn listed(&self) -> bool {
        self.listed
    }

    /// The objects by name.
    pub(super) fn objects(&self) -> &BTreeMap<String, DynamicObject> {
        &self.objects
    }
}

fn name(o: &DynamicObject) -> String {
    o.metadata.name.clone().unwrap_or_default()
}

/// Whether an event proves the API answered (`Init` is emitted before anything is requested).
pub(super) fn proves_contact(event: &Event<DynamicObject>) -> bool {
    !matches!(event, Event::Init)
}

/// Doubling delays between failed watch sessions.
pub(super) struct Backoff {
    next: Duration,
}

impl Backoff {
    const MIN: Duration = Duration::from_millis(200);
    const MAX: Duration = Duration::from_secs(5);

    /// Starts at the shortest delay.
    pub(super) fn new() -> Backoff {
        Backoff { next: Self::MIN }
    }

    /// The delay to wait now; the following one doubles up to the maximum.
    pub(super) fn next(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(Self::MAX);
        d
    }

    /// Back to the shortest delay (after a session that made progress).
    pub(super) fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(name: &str) -> DynamicObject {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap()
    }

    #[test]
    fn a_relist_replaces_the_store() {
        let mut s = Store::default();
        for e in [
            Event::Init,
            Event::InitApply(obj("a")),
            Event::InitApply(obj("b")),
        ] {
            assert!(!s.apply(e));
        }
        assert!(!s.listed() && s.objects().is_empty());
        assert!(s.apply(Event::InitDone));
        assert_eq!(s.objects().len(), 2);
        assert!(s.apply(Event::Delete(obj("a"))));
        assert!(s.apply(Event::Apply(obj("c"))));
        // A relist that no longer has `b`: it was deleted while the watch was away.
        s.apply(Event::Init);
        s.apply(Event::InitApply(obj("c")));
        assert_eq!(
            s.objects().len(),
            2,
            "the old view stays until the list completes"
        );
        s.apply(Event::InitDone);
        assert_eq!(s.objects().keys().collect::<Vec<_>>(), vec!["c"]);
    }

    #[test]
    fn backoff_doubles_and_resets() {
        let mut b = Backoff::new();
        let seq: Vec<u128> = (0..7).map(|_| b.next().as_millis()).collect();
        assert_eq!(seq, vec![200, 400, 800, 1600, 3200, 5000, 5000]);
        b.reset();
        assert_eq!(b.next().as_millis(), 200);
    }
}
