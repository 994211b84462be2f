//! Fencing of single-reader sources: ownership epochs, leases, and the stale-batch rule.
//!
//! Rendezvous hashing says which replica *should* own a TensorRT-LLM drain; this module makes
//! sure at most one drains it even when replicas disagree for a while (a paused process, a cut
//! link, a restart), with three rules:
//!
//! - **Claims with epochs.** A replica that should own a source claims it one epoch above every
//!   epoch it has seen for that source, and shows the claim in `Hello`. It does not claim while
//!   a peer it sees holds a claim on the source (that peer stands down first when it sees it is
//!   no longer the owner), and it gives its own claim up as soon as it sees a higher
//!   `(epoch, instance)` claim, or, while draining, any claim of a peer at all (that peer did
//!   not see ours when it claimed: a one-way cut, or answers that reach it too late; it starts
//!   after its handoff whatever the ranks). A claim becomes active (draining) only after the
//!   handoff delay.
//!   Replicas also pass on the highest draining claim they know per source, so one that cannot
//!   reach a new owner learns it was superseded from a peer that can.
//! - **Leases.** Every drain must be admitted ([`Fencing::admit`]): the claim is active and its
//!   lease, renewed by each completed probe round that saw no peer's claim on the source to
//!   `round start + 2.5 probe intervals` (a probe waits at most one interval), has not run out
//!   on the monotonic clock. A process that was paused (SIGSTOP, a GC pause, a throttled
//!   or frozen host) finds its lease expired when it resumes and drains nothing until a probe
//!   round started *after* the pause confirms it still owns the source; by then its peers, who
//!   stop waiting for it after 3 intervals and then wait the 3-interval handoff, have not started
//!   draining, or it sees their higher claim and stands down.
//! - **Stale batches refused.** An activated claim names where the previous owner's batches end
//!   (`prev`: its instance and the relay sequence this replica had reached); a relayed batch of a
//!   superseded epoch at or beyond that point was drained after the handover and is refused by
//!   every replica (the origin included), so a late drain cannot make replicas disagree.
//!   A replica whose batches may have been refused says so (it is *diverged*) and the owner
//!   clears the source everywhere: when the successor's cut falls before the end of its own
//!   batches ([`Fencing::cut_off`]), or when the successor did not name it at all (it claimed
//!   without seeing this replica; [`Fencing::flag_unnamed_successors`]).
//!
//! - **Forgetting.** State of a worker outside this replica's pool that nobody has claimed or
//!   drained (as far as this replica sees directly: a peer's own claims, any relayed batch) for
//!   [`FORGET_AFTER`] is dropped ([`Fencing::tend`]), so pod churn does not grow it, nor the
//!   `Hello` that carries the fences, for ever. Its highest epoch raises a floor under every
//!   later claim, so a claim is never lower than it would have been had nothing been forgotten.
//!   A fence passed on by a peer is taken in only for a worker of this replica's pool or one it
//!   tracks already (else two replicas would keep an abandoned worker alive by passing it back
//!   and forth); a go-between that sees the drainer directly tracks it, so the fence still
//!   travels. At most [`MAX_FOREIGN`] workers outside the pool are tracked; claims on more are
//!   ignored and counted.
//!
//! Pure bookkeeping under one lock; the caller does the I/O.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;

use kv_epp_core::worker::WorkerId;

/// The highest ownership epoch a replica can reach: a drain Lease's floor is at most
/// `(2^31 + 1) << 32` (`lease.rs`: the Lease's transitions, capped at 2^31, above the low 32
/// bits), and claims count up from a floor by one per takeover. A peer's claim or batch above it
/// is refused and counted: taken in, it would make the next claim's `seen + 1` wrap (to the
/// "no fencing" epoch 0 or below every fence), so one bad message could stop a source for good.
pub(crate) const MAX_EPOCH: u64 = ((1 << 31) + 2) << 32;

/// How long a worker outside this replica's pool is remembered after the last claim or batch on
/// it this replica saw: far beyond any pause or cut the fencing rides out (a replica frozen
/// longer finds its lease lapsed and drains nothing until it has heard its peers again).
pub(crate) const FORGET_AFTER: Duration = Duration::from_secs(600);

/// Most workers outside this replica's pool it tracks at once (a pool's workers, and workers
/// whose batches it applies, are always tracked). A deployment's churn within [`FORGET_AFTER`]
/// stays far below it; a peer that names more is refused and counted. Their fences in a
/// `Hello` come to about 0.9 MB, well under `peers.max_message_bytes`.
pub(crate) const MAX_FOREIGN: usize = 16_384;

/// The highest epoch a forgotten worker raises the floor to. Only a broken or hostile peer
/// sends epochs above it (a Lease's floor is at most `MAX_EPOCH - 2^32`); capped, such an
/// epoch cannot push every later claim, on any worker, past [`MAX_EPOCH`], where peers would
/// refuse them.
const FLOOR_CAP: u64 = MAX_EPOCH - (1 << 32);

/// This replica's claim on a source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Claim {
    /// The ownership epoch.
    pub epoch: u64,
    /// Draining (the handoff is over).
    pub active: bool,
    /// The previous owner's instance and where its batches end.
    pub prev: Option<(u64, u64)>,
    /// Drains are admitted until then.
    pub lease_until: Option<Instant>,
    /// When we last cleared the source in our relay stream because a replica diverged on it.
    pub cleared_at: Option<Instant>,
}

/// The highest active claim known for a source (ours or a peer's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fence {
    /// Its epoch.
    pub epoch: u64,
    /// The claiming replica.
    pub owner: u64,
    /// The owner before it and where that one's batches end.
    pub prev: Option<(u64, u64)>,
}

/// Why a batch may or may not be applied ([`Fencing::judge_batch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Apply it.
    Accepted,
    /// Drained under a superseded ownership epoch, beyond its successor's cut or after its clear.
    Superseded,
    /// Its epoch is beyond any a replica can reach (counted in the fencing's own counter).
    OutOfRange,
}

/// What a drain is stamped with: the epoch it was admitted under and the previous owner's cut.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ticket {
    /// The ownership epoch (0: no replication, nothing to fence).
    pub epoch: u64,
    /// The previous owner and where its batches end.
    pub prev: Option<(u64, u64)>,
}

#[derive(Default)]
struct Inner {
    claims: HashMap<WorkerId, Claim>,
    /// Highest epoch seen per source, from anyone's claims or batches.
    seen: HashMap<WorkerId, u64>,
    fences: HashMap<WorkerId, Fence>,
    /// Sources this replica holds refused events of.
    diverged: std::collections::HashSet<WorkerId>,
    /// The cut each source was last flagged diverged for.
    flagged_cuts: HashMap<WorkerId, u64>,
    /// The (epoch, owner) under which each source was last cleared in a relay stream.
    cleared: HashMap<WorkerId, (u64, u64)>,
    /// The epoch of our latest own batch per source, until a successor's fence outranks it.
    drained: HashMap<WorkerId, u64>,
    /// Every tracked worker (the other maps hold only these): when it was last in this
    /// replica's pool, claimed (by us, or by a peer in its own `Hello`) or drained.
    touched: HashMap<WorkerId, Instant>,
    /// How many tracked workers were outside the pool at the last [`Fencing::tend`], plus those
    /// tracked since.
    foreign: usize,
    /// The highest epoch of any forgotten worker: every claim is made above it.
    floor: u64,
}

/// Where a peer's claim comes from ([`Fencing::observe_claim`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Heard {
    /// In the claimer's own `Hello`, or passed on by a peer whose pool has the worker (or that
    /// does not say): it keeps the worker tracked.
    Direct,
    /// Passed on by a peer whose pool lacks the worker.
    Relayed,
}

impl Heard {
    /// How a fence on `worker` passed on in a peer's `Hello.fences` counts, given that peer's
    /// pool (`None`: it does not say, as before pools were exchanged). A peer that has the
    /// worker knows it is live, so what it passes on keeps the worker tracked here too: a
    /// replica whose pool lacks the worker still carries the fence on, from a pool holder that
    /// learned it second-hand to a replica that cannot hear the drainer. Only fences passed
    /// between replicas that all lack the worker stop being taken in, which is what lets them
    /// forget it.
    pub(crate) fn of_fence(
        sender_pool: Option<&std::collections::HashSet<String>>,
        worker: &str,
    ) -> Heard {
        match sender_pool {
            Some(pool) if !pool.contains(worker) => Heard::Relayed,
            _ => Heard::Direct,
        }
    }
}

/// Claims, leases and fences of one replica.
pub(crate) struct Fencing {
    instance: u64,
    inner: Mutex<Inner>,
    /// Peers' claims and batches refused for an epoch above [`MAX_EPOCH`].
    refused: Counter,
    /// Peers' claims not tracked: [`MAX_FOREIGN`] workers outside the pool were.
    untracked: Counter,
    /// Whether such a refusal was logged (once: a peer that sends them sends them every probe).
    logged: std::sync::atomic::AtomicBool,
}

impl Fencing {
    pub(crate) fn new(instance: u64, refused: Counter, untracked: Counter) -> Fencing {
        Fencing {
            instance,
            inner: Mutex::new(Inner::default()),
            refused,
            untracked,
            logged: Default::default(),
        }
    }

    /// Whether `epoch`, from a peer, is one a replica can reach; counts it when not.
    fn in_range(&self, epoch: u64) -> bool {
        if epoch <= MAX_EPOCH {
            return true;
        }
        self.refused.inc();
        if !self.logged.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                epoch,
                "a peer sent an ownership epoch no replica can reach; ignored (logged once, \
                 counted in kv_epp_replica_epochs_refused_total)"
            );
        }
        false
    }

    /// Our claim on `w`, if any.
    pub(crate) fn claim_of(&self, w: &WorkerId) -> Option<Claim> {
        self.inner.lock().claims.get(w).cloned()
    }

    /// Every claim of ours.
    pub(crate) fn claims(&self) -> Vec<(WorkerId, Claim)> {
        let st = self.inner.lock();
        let mut v: Vec<(WorkerId, Claim)> =
            st.claims.iter().map(|(w, c)| (*w, c.clone())).collect();
        v.sort_by_key(|(w, _)| *w);
        v
    }

    /// Claims `w` (pending) one above every epoch seen for it; an existing claim is kept.
    #[cfg(test)]
    pub(crate) fn claim(&self, w: WorkerId) -> u64 {
        self.claim_above(w, 0)
    }

    /// Claims `w` (pending) one above every epoch seen for it and above `floor` (a drain
    /// Lease's transitions: a new holder's claims outrank the previous holder's even when
    /// neither saw the other's); an existing claim is kept.
    pub(crate) fn claim_above(&self, w: WorkerId, floor: u64) -> u64 {
        let mut st = self.inner.lock();
        if let Some(c) = st.claims.get(&w) {
            return c.epoch;
        }
        let seen = st.seen.get(&w).copied().unwrap_or(0).max(st.floor);
        let epoch = seen.saturating_add(1).max(floor.saturating_add(1));
        st.seen.insert(w, epoch);
        st.touch(w, Instant::now());
        st.claims.insert(
            w,
            Claim {
                epoch,
                active: false,
                prev: None,
                lease_until: None,
                cleared_at: None,
            },
        );
        epoch
    }

    /// Sources whose highest fence cuts this replica's own batches off: `(source, cut)`.
    pub(crate) fn cut_off(&self) -> Vec<(WorkerId, u64)> {
        let st = self.inner.lock();
        st.fences
            .iter()
            .filter_map(|(w, f)| match f.prev {
                Some((o, cut)) if o == self.instance && f.owner != self.instance => Some((*w, cut)),
                _ => None,
            })
            .collect()
    }

    /// Notes that this replica holds events of `w` its peers refused (it drained beyond a
    /// later owner's cut); reported in `Hello` until the owner's clear of `w` is applied.
    pub(crate) fn set_diverged(&self, w: WorkerId, diverged: bool) {
        let mut st = self.inner.lock();
        if diverged {
            st.touch(w, Instant::now());
            st.diverged.insert(w);
        } else {
            st.diverged.remove(&w);
        }
    }

    /// Flags `w` as diverged past `cut`, once per cut (a clear un-flags it for good).
    pub(crate) fn flag_diverged_once(&self, w: WorkerId, cut: u64) -> bool {
        let mut st = self.inner.lock();
        if st.flagged_cuts.get(&w) == Some(&cut) {
            return false;
        }
        st.touch(w, Instant::now());
        st.flagged_cuts.insert(w, cut);
        st.diverged.insert(w);
        true
    }

    /// Flags (and returns) the sources whose successor took over without naming this replica:
    /// the highest fence outranks the epoch of our latest own batch and its `prev` is not ours.
    /// It claimed without seeing our drain (a one-way cut, or our claim reached it late), so
    /// every peer that learned its fence before our last batches arrived refused them, and we
    /// may hold events they lack. A successor that names us declares a cut, and [`cut_off`]
    /// covers that case. Each epoch of ours is looked at once, when it is outranked.
    ///
    /// [`cut_off`]: Fencing::cut_off
    pub(crate) fn flag_unnamed_successors(&self) -> Vec<WorkerId> {
        let me = self.instance;
        let mut st = self.inner.lock();
        let Inner {
            drained,
            fences,
            diverged,
            ..
        } = &mut *st;
        let mut flagged = Vec::new();
        drained.retain(|w, epoch| match fences.get(w) {
            Some(f) if (f.epoch, f.owner) > (*epoch, me) => {
                if !matches!(f.prev, Some((o, _)) if o == me) {
                    flagged.push(*w);
                }
                false
            }
            _ => true,
        });
        diverged.extend(flagged.iter().copied());
        flagged
    }

    /// The sources this replica diverged on.
    pub(crate) fn diverged(&self) -> Vec<WorkerId> {
        self.inner.lock().diverged.iter().copied().collect()
    }

    /// Whether our active claim on `w` may clear it now (not within `every` of the last clear);
    /// records the clear.
    pub(crate) fn may_clear(&self, w: &WorkerId, now: Instant, every: std::time::Duration) -> bool {
        let mut st = self.inner.lock();
        match st.claims.get_mut(w) {
            Some(c) if c.active && c.cleared_at.is_none_or(|t| now.duration_since(t) >= every) => {
                c.cleared_at = Some(now);
                true
            }
            _ => false,
        }
    }

    /// The highest active claim known per source.
    pub(crate) fn fences(&self) -> Vec<(WorkerId, Fence)> {
        let st = self.inner.lock();
        st.fences.iter().map(|(w, f)| (*w, *f)).collect()
    }

    /// Whether our claim on `w` is outranked by a higher active claim we know of (it can never
    /// drain again: it must be given up and made anew above it).
    pub(crate) fn superseded(&self, w: &WorkerId) -> bool {
        let st = self.inner.lock();
        match (st.claims.get(w), st.fences.get(w)) {
            (Some(c), Some(f)) => (f.epoch, f.owner) > (c.epoch, self.instance),
            _ => false,
        }
    }

    /// Gives the claim on `w` up; its drains are no longer admitted.
    pub(crate) fn release(&self, w: &WorkerId) -> bool {
        self.inner.lock().claims.remove(w).is_some()
    }

    /// Makes our claim on `w` active, with the previous owner's cut and a first lease.
    pub(crate) fn activate(&self, w: &WorkerId, prev: Option<(u64, u64)>, lease_until: Instant) {
        let mut st = self.inner.lock();
        let Some(c) = st.claims.get_mut(w) else {
            return;
        };
        c.active = true;
        c.prev = prev;
        c.lease_until = Some(lease_until);
        let fence = Fence {
            epoch: c.epoch,
            owner: self.instance,
            prev,
        };
        raise(&mut st.fences, *w, fence);
    }

    /// The previous owner of `w` as far as this replica knows (the highest fence, if not ours).
    pub(crate) fn previous_owner(&self, w: &WorkerId) -> Option<u64> {
        let st = self.inner.lock();
        st.fences
            .get(w)
            .map(|f| f.owner)
            .filter(|&o| o != self.instance)
    }

    /// Extends the lease of our active claim on `w` to `until` (never shortens it), unless a
    /// higher fence is known.
    pub(crate) fn renew(&self, w: &WorkerId, until: Instant) {
        let mut st = self.inner.lock();
        let top = st.fences.get(w).copied();
        let Some(c) = st.claims.get_mut(w) else {
            return;
        };
        if top.is_some_and(|f| (f.epoch, f.owner) > (c.epoch, self.instance)) {
            return;
        }
        if c.active && c.lease_until.is_none_or(|t| t < until) {
            c.lease_until = Some(until);
        }
    }

    /// Whether a drain of `w` may start now: our claim is active, its lease holds and no higher
    /// claim is known. The ticket stamps the drain's batches.
    pub(crate) fn admit(&self, w: &WorkerId, now: Instant) -> Option<Ticket> {
        let st = self.inner.lock();
        let c = st.claims.get(w)?;
        if !c.active || c.lease_until.is_none_or(|t| now >= t) {
            return None;
        }
        if st
            .fences
            .get(w)
            .is_some_and(|f| (f.epoch, f.owner) > (c.epoch, self.instance))
        {
            return None;
        }
        Some(Ticket {
            epoch: c.epoch,
            prev: c.prev,
        })
    }

    /// Notes a peer's claim (from a `Hello`): its epoch is seen, and an active one raises the
    /// fence. A claim above [`MAX_EPOCH`] is ignored (and counted). `in_pool`: `w` is in this
    /// replica's pool. A relayed claim on a worker neither in the pool nor tracked is ignored,
    /// and a direct one past [`MAX_FOREIGN`] is ignored and counted (see the module doc).
    pub(crate) fn observe_claim(
        &self,
        w: WorkerId,
        heard: Heard,
        in_pool: bool,
        claim: Fence,
        active: bool,
        now: Instant,
    ) {
        let Fence { epoch, owner, prev } = claim;
        if !self.in_range(epoch) {
            return;
        }
        let mut st = self.inner.lock();
        if !st.touched.contains_key(&w) {
            if heard == Heard::Relayed && !in_pool {
                return;
            }
            if !in_pool && st.foreign >= MAX_FOREIGN {
                self.untracked.inc();
                return;
            }
            st.touch(w, now);
        } else if heard == Heard::Direct || in_pool {
            st.touch(w, now);
        }
        let seen = st.seen.entry(w).or_insert(0);
        *seen = (*seen).max(epoch);
        if active {
            raise(&mut st.fences, w, Fence { epoch, owner, prev });
        }
    }

    /// Notes that `w` was cleared by a batch of `origin` under `epoch` (a clear after a
    /// divergence): the superseded owner's batches from before the cut, which every replica
    /// that had them applied before that clear, are refused from now on, so a replica that
    /// receives them late does not apply them after it.
    pub(crate) fn note_cleared(&self, w: WorkerId, epoch: u64, origin: u64) {
        let mut st = self.inner.lock();
        st.touch(w, Instant::now());
        st.cleared.insert(w, (epoch, origin));
    }

    /// Whether a relayed (or own) batch of `w` from `origin` at `seq`, drained under `ticket`,
    /// may be applied. A batch of the highest epoch raises the fence; one of a superseded epoch
    /// passes only if it comes before the cut its successor declared, and that successor has not
    /// cleared the source since. A batch above [`MAX_EPOCH`] is refused (and counted).
    pub(crate) fn accept_batch(&self, w: WorkerId, origin: u64, seq: u64, ticket: Ticket) -> bool {
        self.judge_batch(w, origin, seq, ticket) == Verdict::Accepted
    }

    /// [`Fencing::accept_batch`], saying why a batch is refused.
    pub(crate) fn judge_batch(
        &self,
        w: WorkerId,
        origin: u64,
        seq: u64,
        ticket: Ticket,
    ) -> Verdict {
        if ticket.epoch == 0 {
            return Verdict::Accepted;
        }
        if !self.in_range(ticket.epoch) {
            return Verdict::OutOfRange;
        }
        let mut st = self.inner.lock();
        // Batches are judged only for workers this replica runs (the caller placed them), so
        // these are bounded by its worker list.
        st.touch(w, Instant::now());
        let seen = st.seen.entry(w).or_insert(0);
        *seen = (*seen).max(ticket.epoch);
        match st.fences.get(&w).copied() {
            Some(f) if (ticket.epoch, origin) < (f.epoch, f.owner) => {
                let before_cut = matches!(f.prev, Some((o, cut)) if o == origin && seq < cut)
                    && st.cleared.get(&w) != Some(&(f.epoch, f.owner));
                if before_cut {
                    Verdict::Accepted
                } else {
                    Verdict::Superseded
                }
            }
            _ => {
                if origin == self.instance {
                    st.drained.insert(w, ticket.epoch);
                }
                raise(
                    &mut st.fences,
                    w,
                    Fence {
                        epoch: ticket.epoch,
                        owner: origin,
                        prev: ticket.prev,
                    },
                );
                Verdict::Accepted
            }
        }
    }
}

impl Fencing {
    /// Once per drain round: `pool` (this replica's single-reader sources) is touched, and every
    /// tracked worker outside it that was not touched for `idle` and is not claimed by us is
    /// forgotten, its highest epoch raising the floor under every later claim. Returns how many
    /// were forgotten.
    pub(crate) fn tend(
        &self,
        pool: &std::collections::HashSet<WorkerId>,
        now: Instant,
        idle: Duration,
    ) -> usize {
        let mut st = self.inner.lock();
        for w in pool {
            st.touch(*w, now);
        }
        let Inner {
            claims,
            seen,
            fences,
            diverged,
            flagged_cuts,
            cleared,
            drained,
            touched,
            foreign,
            floor,
        } = &mut *st;
        let before = touched.len();
        touched.retain(|w, t| {
            // Diverged or not: a worker outside the pool has no blocks in this replica's index.
            let keep = pool.contains(w)
                || now.saturating_duration_since(*t) < idle
                || claims.contains_key(w);
            if !keep {
                *floor = (*floor).max(seen.remove(w).unwrap_or(0).min(FLOOR_CAP));
                fences.remove(w);
                diverged.remove(w);
                flagged_cuts.remove(w);
                cleared.remove(w);
                drained.remove(w);
            }
            keep
        });
        *foreign = touched.keys().filter(|w| !pool.contains(w)).count();
        before - touched.len()
    }

    /// The epoch of the fence on `w`, if any.
    #[cfg(test)]
    pub(crate) fn fence_epoch(&self, w: &WorkerId) -> Option<u64> {
        self.inner.lock().fences.get(w).map(|f| f.epoch)
    }

    /// How many workers this replica tracks (its pool's and others').
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.inner.lock().touched.len()
    }
}

impl Inner {
    /// Marks `w` tracked and touched at `now` (a new one counts as foreign until the next
    /// [`Fencing::tend`] says otherwise).
    fn touch(&mut self, w: WorkerId, now: Instant) {
        if self.touched.insert(w, now).is_none() {
            self.foreign += 1;
        }
    }
}

fn raise(fences: &mut HashMap<WorkerId, Fence>, w: WorkerId, f: Fence) {
    let e = fences.entry(w).or_insert(f);
    if (f.epoch, f.owner) > (e.epoch, e.owner) {
        *e = f;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn w() -> WorkerId {
        WorkerId::new("10.0.0.1:8000".parse().unwrap())
    }

    fn fencing(instance: u64) -> Fencing {
        Fencing::new(instance, Counter::default(), Counter::default())
    }

    /// A peer's claim on `w()` as its own `Hello` shows it, `w()` being in our pool.
    fn observe(f: &Fencing, owner: u64, epoch: u64, active: bool, prev: Option<(u64, u64)>) {
        let claim = Fence { epoch, owner, prev };
        f.observe_claim(w(), Heard::Direct, true, claim, active, Instant::now());
    }

    #[test]
    fn a_lapsed_lease_admits_nothing_until_renewed() {
        let f = fencing(1);
        let t0 = Instant::now();
        assert_eq!(f.claim(w()), 1);
        assert!(f.admit(&w(), t0).is_none(), "pending claims do not drain");
        f.activate(&w(), None, t0 + Duration::from_millis(400));
        assert_eq!(f.admit(&w(), t0).unwrap().epoch, 1);
        // Paused past the lease: nothing until a fresh probe round renews it.
        let later = t0 + Duration::from_secs(3);
        assert!(f.admit(&w(), later).is_none());
        f.renew(&w(), later + Duration::from_millis(400));
        assert!(f.admit(&w(), later).is_some());
    }

    #[test]
    fn a_higher_claim_fences_the_old_owner_and_its_late_batches() {
        let (old, new, third) = (1u64, 2u64, 3u64);
        let o = fencing(old);
        let n = fencing(new);
        let r = fencing(third);
        let t = Instant::now() + Duration::from_secs(60);
        o.claim(w());
        o.activate(&w(), None, t);
        let ot = o.admit(&w(), Instant::now()).unwrap();
        for x in [&n, &r] {
            assert!(x.accept_batch(w(), old, 0, ot));
            assert!(x.accept_batch(w(), old, 1, ot));
        }
        // The new owner claims above what it saw, and cuts the old owner's batches at 2.
        assert_eq!(n.claim(w()), 2);
        n.activate(&w(), Some((old, 2)), t);
        let nt = n.admit(&w(), Instant::now()).unwrap();
        assert!(r.accept_batch(w(), new, 0, nt));
        // A batch the old owner drained before the cut still counts; one after it does not,
        // on every replica alike.
        for x in [&n, &r] {
            assert!(!x.accept_batch(w(), old, 2, ot));
        }
        assert!(r.accept_batch(w(), old, 1, ot), "before the cut");
        // Once the new owner cleared the source, a lagging replica no longer applies the old
        // owner's earlier batches (the others applied them before the clear erased them).
        r.note_cleared(w(), nt.epoch, new);
        assert!(!r.accept_batch(w(), old, 1, ot), "after the clear");
        // The old owner learns the higher claim and stops admitting drains.
        observe(&o, new, 2, true, Some((old, 2)));
        assert!(o.admit(&w(), Instant::now()).is_none());
        assert!(
            !o.accept_batch(w(), old, 2, ot),
            "its own late batch is refused too"
        );
        o.renew(&w(), t);
        assert!(
            o.admit(&w(), Instant::now()).is_none(),
            "no renewal past a higher fence"
        );
        // A later claim by the old owner goes above everything seen.
        o.release(&w());
        assert_eq!(o.claim(w()), 3);
    }

    #[test]
    fn an_epoch_no_replica_can_reach_is_refused_and_counted() {
        let refused = Counter::default();
        let f = Fencing::new(1, refused.clone(), Counter::default());
        observe(&f, 2, u64::MAX, true, None);
        observe(&f, 2, MAX_EPOCH + 1, false, None);
        let wild = Ticket {
            epoch: u64::MAX,
            prev: None,
        };
        assert!(!f.accept_batch(w(), 2, 0, wild), "its batch is refused");
        assert_eq!(refused.get(), 3);
        assert!(f.fences().is_empty(), "it raised no fence");
        assert_eq!(
            f.claim(w()),
            1,
            "the next claim counts from what was in range"
        );
        // Epochs a Lease can give are taken in.
        let lease_epoch = ((1u64 << 31) + 1) << 32;
        observe(&f, 2, lease_epoch, true, None);
        assert!(f.superseded(&w()));
        assert_eq!(refused.get(), 3);
    }

    /// A drainer whose successor claimed without seeing it (the same epoch, a higher instance,
    /// and no cut naming it) flags itself diverged, once: peers that learned the successor's
    /// fence first refused its last batches. A successor that names it, or a fence below its
    /// epoch, flags nothing here.
    #[test]
    fn a_successor_that_did_not_name_the_drainer_flags_it_diverged() {
        let (me, other) = (1u64, 2u64);
        let t = Instant::now() + Duration::from_secs(60);
        let drain = |f: &Fencing| {
            f.claim(w());
            f.activate(&w(), None, t);
            let tk = f.admit(&w(), Instant::now()).unwrap();
            assert!(f.accept_batch(w(), me, 0, tk));
            tk.epoch
        };
        let f = fencing(me);
        let e = drain(&f);
        // A fence below ours (a predecessor) is no successor.
        observe(&f, other, e - 1, true, None);
        assert!(f.flag_unnamed_successors().is_empty());
        // Claims crossed: the same epoch, a higher instance, no cut of ours.
        observe(&f, other, e, true, None);
        assert_eq!(f.flag_unnamed_successors(), vec![w()]);
        assert_eq!(f.diverged(), vec![w()]);
        assert!(f.flag_unnamed_successors().is_empty(), "once");

        // A successor that names us declares a cut instead (`cut_off`).
        let g = fencing(me);
        let e = drain(&g);
        observe(&g, other, e + 1, true, Some((me, 1)));
        assert!(g.flag_unnamed_successors().is_empty());
        assert!(g.diverged().is_empty());
        assert_eq!(g.cut_off(), vec![(w(), 1)]);
    }

    fn worker(i: u32) -> WorkerId {
        let ip = format!("10.{}.{}.{}", 1 + i / 62_500, i / 250 % 250, i % 250);
        WorkerId::new(format!("{ip}:8000").parse().unwrap())
    }

    fn heard(epoch: u64, owner: u64) -> Fence {
        Fence {
            epoch,
            owner,
            prev: None,
        }
    }

    /// A worker that left the pool and that nobody claims is forgotten after the idle time, not
    /// before, with every trace of it (its fence leaves the `Hello`); while in the pool, claimed
    /// by us or claimed by a peer directly it stays. Its highest epoch stays as a floor: a later
    /// claim on any worker goes above it, as it would have had nothing been forgotten.
    #[test]
    fn an_abandoned_worker_is_forgotten_and_its_epochs_stay_a_floor() {
        let f = fencing(1);
        let idle = Duration::from_secs(600);
        let t0 = Instant::now();
        let (a, b) = (w(), worker(2));
        let pool: HashSet<WorkerId> = [a].into();
        f.tend(&pool, t0, idle);
        f.observe_claim(b, Heard::Direct, false, heard(7, 2), true, Instant::now());
        observe(&f, 2, 3, true, None);
        assert_eq!(f.fences().len(), 2);
        // Idle for less than the limit: kept.
        assert_eq!(f.tend(&pool, t0 + idle / 2, idle), 0);
        // `b` idle beyond it: forgotten; `a`, in the pool, is not (though as old).
        let later = t0 + idle * 2;
        assert_eq!(f.tend(&pool, later, idle), 1);
        assert_eq!(f.tracked(), 1);
        assert_eq!(f.fences().len(), 1, "b's fence no longer goes out");
        // b's epoch 7 is a floor: a claim on b, or on a fresh worker, goes above it.
        assert_eq!(f.claim_above(b, 0), 8);
        assert_eq!(f.claim_above(worker(3), 0), 8);
        // `a` leaves the pool while we claim it: kept until released, then forgotten once idle.
        let f = fencing(1);
        f.claim(a);
        f.tend(&pool, later, idle);
        let none = HashSet::new();
        assert_eq!(f.tend(&none, later + idle * 2, idle), 0, "claimed by us");
        f.release(&a);
        let gone = later + idle * 2;
        assert_eq!(f.tend(&none, gone, idle), 1, "idle since it left the pool");
        // A peer's direct claims keep a worker outside the pool alive.
        let f = fencing(1);
        f.observe_claim(b, Heard::Direct, false, heard(2, 2), false, t0);
        f.observe_claim(b, Heard::Direct, false, heard(2, 2), true, t0 + idle);
        assert_eq!(f.tend(&none, t0 + idle, idle), 0);
        assert_eq!(f.tend(&none, t0 + idle * 3 / 2, idle), 0);
        assert_eq!(f.tracked(), 1);
    }

    /// A fence passed on by a peer is taken in for a worker of the pool or one tracked already
    /// (a go-between that hears the drainer itself passes it on), never for another: two
    /// replicas passing an abandoned worker's fence back and forth would keep it for ever.
    #[test]
    fn passed_on_fences_do_not_keep_an_abandoned_worker() {
        let idle = Duration::from_secs(600);
        let t0 = Instant::now();
        let b = worker(2);
        let none = HashSet::new();
        // Unknown, outside the pool: ignored.
        let f = fencing(1);
        f.observe_claim(b, Heard::Relayed, false, heard(5, 3), true, Instant::now());
        assert_eq!(f.tracked(), 0);
        assert!(f.fences().is_empty());
        // In the pool: taken in.
        f.observe_claim(b, Heard::Relayed, true, heard(5, 3), true, Instant::now());
        assert!(f.fences().iter().any(|(w, fe)| *w == b && fe.epoch == 5));
        // Tracked because the drainer was heard directly: a higher relayed fence raises it.
        let g = fencing(1);
        g.observe_claim(b, Heard::Direct, false, heard(5, 3), true, Instant::now());
        g.observe_claim(b, Heard::Relayed, false, heard(6, 4), true, Instant::now());
        assert_eq!(g.fence_epoch(&b), Some(6));
        // Two replicas passing the fence back and forth: it is forgotten by both once nobody
        // claims it directly, at different moments, and not taken in again.
        let (x, y) = (fencing(1), fencing(2));
        x.observe_claim(b, Heard::Direct, false, heard(5, 3), true, t0);
        y.observe_claim(b, Heard::Direct, false, heard(5, 3), true, t0);
        let mut now = t0;
        for step in 0..40 {
            now += idle / 10;
            for (from, to) in [(&x, &y), (&y, &x)] {
                for (w, fe) in from.fences() {
                    to.observe_claim(w, Heard::Relayed, false, fe, true, now);
                }
            }
            // x tends every step, y every other one: they forget at different times.
            x.tend(&none, now, idle);
            if step % 2 == 0 {
                y.tend(&none, now, idle);
            }
        }
        assert_eq!((x.tracked(), y.tracked()), (0, 0));
        assert!(x.fences().is_empty() && y.fences().is_empty());
    }

    /// At most `MAX_FOREIGN` workers outside the pool are tracked: a peer naming more is
    /// refused and counted, the pool's workers are still tracked, and forgetting makes room.
    #[test]
    fn workers_outside_the_pool_are_tracked_up_to_a_limit() {
        let untracked = Counter::default();
        let f = Fencing::new(1, Counter::default(), untracked.clone());
        let t0 = Instant::now();
        let idle = Duration::from_secs(600);
        for i in 0..MAX_FOREIGN as u32 + 10 {
            f.observe_claim(
                worker(i),
                Heard::Direct,
                false,
                heard(1, 2),
                false,
                Instant::now(),
            );
        }
        assert_eq!(f.tracked(), MAX_FOREIGN);
        assert_eq!(untracked.get(), 10);
        let own = worker(MAX_FOREIGN as u32 + 100);
        f.observe_claim(own, Heard::Relayed, true, heard(4, 2), true, Instant::now());
        assert!(
            f.fences().iter().any(|(w, _)| *w == own),
            "a pool worker is"
        );
        // A batch (only ever judged for a worker this replica runs) is tracked and fenced.
        let extra = worker(MAX_FOREIGN as u32 + 200);
        let t = Ticket {
            epoch: 3,
            prev: None,
        };
        assert!(f.accept_batch(extra, 2, 0, t));
        assert_eq!(f.tracked(), MAX_FOREIGN + 2);
        assert_eq!(f.fence_epoch(&extra), Some(3));
        let pool: HashSet<WorkerId> = [own, extra].into();
        assert_eq!(f.tend(&pool, t0 + idle * 2, idle), MAX_FOREIGN);
        f.observe_claim(
            worker(1),
            Heard::Direct,
            false,
            heard(1, 2),
            false,
            Instant::now(),
        );
        assert_eq!(f.tracked(), 3);
        assert_eq!(untracked.get(), 10);
    }
    /// A fence has to travel through a replica whose pool lacks the worker: O drains W; Q
    /// (W in its pool) hears O; C (no W) hears only Q; A (W in its pool) hears only C. C must
    /// take Q's fence in and pass it on, because Q has W: A then claims above O, names O as
    /// the previous owner, and O, hearing A's claim through Q, stands down. Had C dropped the
    /// fence, A would claim at 1, below O's 57: O would keep draining beside A, and Q would
    /// refuse A's batches.
    #[test]
    fn a_fence_passes_through_a_replica_that_lacks_the_worker() {
        let (o, q, c, a) = (10u64, 20u64, 30u64, 40u64);
        let t = Instant::now() + Duration::from_secs(60);
        let now = Instant::now();
        let wk = w();
        let name = wk.to_string();
        let with_w: HashSet<String> = [name.clone()].into();
        let without_w: HashSet<String> = HashSet::new();
        let pass = |from: &Fencing, from_pool: &HashSet<String>, to: &Fencing, to_has: bool| {
            for (wi, fe) in from.fences() {
                let heard = Heard::of_fence(Some(from_pool), &wi.to_string());
                to.observe_claim(wi, heard, to_has, fe, true, now);
            }
        };
        let of = fencing(o);
        observe(&of, 99, 56, false, None);
        assert_eq!(of.claim_above(wk, 0), 57);
        of.activate(&wk, None, t);
        let qf = fencing(q);
        observe(&qf, o, 57, true, None);
        let cf = fencing(c);
        pass(&qf, &with_w, &cf, false);
        let af = fencing(a);
        pass(&cf, &without_w, &af, true);
        assert_eq!(af.claim_above(wk, 0), 58, "A claims above O");
        let prev = af.previous_owner(&wk).map(|p| (p, 0));
        assert_eq!(prev, Some((o, 0)), "and names O");
        af.activate(&wk, prev, t);
        let mine = af.claim_of(&wk).unwrap();
        let claim = Fence {
            epoch: mine.epoch,
            owner: a,
            prev: mine.prev,
        };
        qf.observe_claim(wk, Heard::Direct, true, claim, true, now);
        pass(&qf, &with_w, &of, true);
        let tk = af.admit(&wk, now).expect("A drains");
        assert!(qf.accept_batch(wk, a, 0, tk), "Q applies A's batches");
        assert!(of.admit(&wk, now).is_none(), "O no longer drains");
        // Between replicas that both lack W, a passed-on fence does not keep it tracked.
        assert_eq!(Heard::of_fence(Some(&without_w), &name), Heard::Relayed);
        assert_eq!(
            Heard::of_fence(None, &name),
            Heard::Direct,
            "a peer that does not say"
        );
    }

    /// A peer's epoch at the very top of the range, on a worker outside the pool, is forgotten
    /// like any other; the floor it leaves is capped, so later claims stay in range and their
    /// batches are applied.
    #[test]
    fn an_extreme_forgotten_epoch_does_not_push_later_claims_out_of_range() {
        let idle = Duration::from_secs(600);
        let t0 = Instant::now();
        let (a, b) = (w(), worker(2));
        let pool: HashSet<WorkerId> = [a].into();
        let f = fencing(1);
        f.tend(&pool, t0, idle);
        f.observe_claim(b, Heard::Direct, false, heard(MAX_EPOCH, 2), true, t0);
        assert_eq!(f.tend(&pool, t0 + idle * 2, idle), 1);
        let e = f.claim_above(a, 0);
        assert!(e <= MAX_EPOCH, "{e}");
        f.activate(&a, None, Instant::now() + Duration::from_secs(60));
        let tk = f.admit(&a, Instant::now()).unwrap();
        assert!(f.accept_batch(a, 1, 0, tk));
    }
}
