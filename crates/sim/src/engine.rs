//! The simulated engine's scheduler, in real time: a `--max-num-seqs` limit on running requests
//! (FIFO beyond it), one prefill at a time (FIFO), the prefix cache, and the KV events each
//! scheduling step produces.
//!
//! A request's life: it waits for a running slot, then for the prefill stage; at the head of the
//! prefill stage it is admitted into the cache (longest cached prefix reused, the rest of its full
//! blocks allocated and announced), sleeps the latency model's prefill time, and leaves the prefill
//! stage with its first token. It holds its blocks and its slot until its [`Running`] guard is
//! dropped (last token sent, or the client went away), so cancellation never leaks blocks.
//!
//! Invariants: the events of one admission are handed to the publisher inside the same critical
//! section that changed the cache, so the published stream is in cache order; a restart bumps the
//! generation and blocks of an older generation are never released into the new cache.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};

use crate::latency::LatencyModel;
use crate::prefix_cache::{CacheEvent, CacheRequest, PrefixCache};

/// Shape and timing of one engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Blocks in the KV pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Requests running at once (prefilling or decoding); more wait.
    pub max_num_seqs: usize,
    /// Latency model.
    pub latency: LatencyModel,
}

/// What the engine hands to the event publisher, in order.
#[derive(Debug)]
pub enum PublishMsg {
    /// The events of one scheduling step (one batch on the wire).
    Batch(Vec<CacheEvent>),
    /// The engine restarted: sequence numbers start again at 0, the replay buffer is empty.
    Restart,
}

/// Why a request cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The prompt needs more blocks than the whole pool.
    #[error("prompt needs {needed} KV blocks but the engine has {total}")]
    PromptTooLong {
        /// Full blocks of the prompt.
        needed: usize,
        /// Blocks in the pool.
        total: usize,
    },
}

/// Load and cache figures for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Requests prefilling or decoding.
    pub running: u32,
    /// Requests waiting for a slot or for the prefill stage.
    pub waiting: u32,
    /// Share of blocks referenced by running requests (0..=1).
    pub kv_cache_usage: f64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Prompt tokens found there.
    pub prefix_hits: u64,
}

struct State {
    cache: PrefixCache,
    generation: u64,
    running: u32,
    waiting: u32,
}

/// One simulated engine.
pub struct Engine {
    config: EngineConfig,
    state: Mutex<State>,
    slots: Arc<Semaphore>,
    prefill: tokio::sync::Mutex<()>,
    freed: Notify,
    events: mpsc::UnboundedSender<PublishMsg>,
}

/// A request that produced its first token: it holds its blocks and running slot until dropped.
pub struct Running {
    engine: Arc<Engine>,
    blocks: Vec<u32>,
    generation: u64,
    _slot: OwnedSemaphorePermit,
    /// Prompt tokens served from the cache (whole blocks).
    pub cached_tokens: usize,
}

impl Drop for Running {
    fn drop(&mut self) {
        {
            let mut s = self.engine.state.lock();
            if s.generation == self.generation {
                s.cache.release(&self.blocks);
            }
            s.running -= 1;
        }
        self.engine.freed.notify_waiters();
    }
}

/// Counts a request as waiting until dropped (also when the client goes away while waiting).
struct Waiting<'a>(&'a Engine);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.state.lock().waiting -= 1;
    }
}

impl Engine {
    /// An engine publishing its events on `events`.
    pub fn new(config: EngineConfig, events: mpsc::UnboundedSender<PublishMsg>) -> Arc<Self> {
        Arc::new(Engine {
            state: Mutex::new(State {
                cache: PrefixCache::new(config.num_blocks, config.block_size),
                generation: 0,
                running: 0,
                waiting: 0,
            }),
            slots: Arc::new(Semaphore::new(config.max_num_seqs.max(1))),
            prefill: tokio::sync::Mutex::new(()),
            freed: Notify::new(),
            events,
            config,
        })
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Prompt tokens `req` would find cached now (no side effects).
    pub fn peek_cached_tokens(&self, req: &CacheRequest<'_>) -> usize {
        self.state.lock().cache.peek_cached_tokens(req)
    }

    /// Current load and cache counters.
    pub fn stats(&self) -> EngineStats {
        let s = self.state.lock();
        EngineStats {
            running: s.running,
            waiting: s.waiting,
            kv_cache_usage: s.cache.used_blocks() as f64 / s.cache.num_blocks().max(1) as f64,
            prefix_queries: s.cache.queries_tokens,
            prefix_hits: s.cache.hit_tokens,
        }
    }

    /// Runs a request up to its first token: waits for a slot and the prefill stage, admits it
    /// into the cache (publishing the step's events), and sleeps its prefill time. Dropping the
    /// future at any point undoes what it did.
    pub async fn start(self: &Arc<Self>, req: &CacheRequest<'_>) -> Result<Running, EngineError> {
        let needed = req.tokens.len() / self.config.block_size.max(1);
        if needed > self.config.num_blocks {
            return Err(EngineError::PromptTooLong {
                needed,
                total: self.config.num_blocks,
            });
        }
        self.state.lock().waiting += 1;
        let waiting = Waiting(self);
        // The semaphore is never closed, so acquiring only ever waits.
        let Ok(slot) = self.slots.clone().acquire_owned().await else {
            unreachable!("the running-slot semaphore is never closed")
        };
        let prefill = self.prefill.lock().await;
        let (admission, generation) = loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut s = self.state.lock();
                if let Ok(adm) = s.cache.admit(req) {
                    s.running += 1;
                    let events = s.cache.take_events();
                    if !events.is_empty() {
                        // A closed channel means the publisher is gone (shutdown): nothing to tell.
                        let _ = self.events.send(PublishMsg::Batch(events));
                    }
                    break (adm, s.generation);
                }
            }
            // Out of blocks: running requests hold them; wait until one finishes.
            freed.await;
        };
        drop(waiting);
        let running = Running {
            engine: self.clone(),
            blocks: admission.blocks,
            generation,
            _slot: slot,
            cached_tokens: admission.cached_tokens,
        };
        let uncached = req.tokens.len() - admission.cached_tokens;
        tokio::time::sleep(self.config.latency.prefill(uncached)).await;
        drop(prefill);
        Ok(running)
    }

    /// Time to generate one more token.
    pub fn decode_step(&self) -> Duration {
        self.config.latency.decode_step()
    }

    /// Drops every cached block and publishes `AllBlocksCleared` (vLLM's `/reset_prefix_cache`).
    pub fn reset_prefix_cache(&self) {
        let mut s = self.state.lock();
        s.cache.clear();
        let events = s.cache.take_events();
        let _ = self.events.send(PublishMsg::Batch(events));
        drop(s);
        self.freed.notify_waiters();
    }

    /// Simulates an engine restart: an empty cache and zeroed counters, sequence numbers from 0,
    /// an empty replay buffer, and no event about the lost state (a real restart sends none).
    /// Requests in flight finish normally; their blocks are not returned to the new cache.
    pub fn restart(&self) {
        let mut s = self.state.lock();
        s.cache = PrefixCache::new(self.config.num_blocks, self.config.block_size);
        s.generation += 1;
        let _ = self.events.send(PublishMsg::Restart);
        drop(s);
        // A request waiting for blocks may fit in the empty cache.
        self.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(max_num_seqs: usize) -> (Arc<Engine>, mpsc::UnboundedReceiver<PublishMsg>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let e = Engine::new(
            EngineConfig {
                num_blocks: 4,
                block_size: 2,
                max_num_seqs,
                latency: LatencyModel {
                    base_us: 0,
                    prefill_us_per_token: 0.0,
                    decode_us_per_token: 0,
                },
            },
            tx,
        );
        (e, rx)
    }

    fn req(tokens: &[u32]) -> CacheRequest<'_> {
        CacheRequest {
            tokens,
            salt: None,
            lora_name: None,
        }
    }

    #[tokio::test]
    async fn admits_publishes_and_releases() {
        let (e, mut rx) = engine(1);
        let r = e.start(&req(&[1, 2, 3, 4, 5])).await.unwrap();
        assert_eq!(r.cached_tokens, 0);
        assert_eq!(e.stats().running, 1);
        assert!(matches!(rx.try_recv(), Ok(PublishMsg::Batch(ev)) if ev.len() == 1));
        // The only slot is taken: a second request waits until the first finishes.
        let e2 = e.clone();
        let second = tokio::spawn(async move {
            let t = [1, 2, 3, 4];
            e2.start(&req(&t)).await.map(|r| r.cached_tokens)
        });
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(e.stats().waiting, 1);
        drop(r);
        assert_eq!(second.await.unwrap(), Ok(4));
        let s = e.stats();
        assert_eq!((s.running, s.waiting, s.prefix_hits), (0, 0, 4));
        assert_eq!(
            e.start(&req(&[0; 10])).await.err(),
            Some(EngineError::PromptTooLong {
                needed: 5,
                total: 4
            })
        );
    }

    #[tokio::test]
    async fn waits_for_blocks_and_survives_restart() {
        let (e, mut rx) = engine(4);
        let a = e.start(&req(&[1, 1, 2, 2, 3, 3])).await.unwrap();
        let e2 = e.clone();
        let b = tokio::spawn(async move {
            let t = [9, 9, 8, 8];
            e2.start(&req(&t)).await.map(|r| r.cached_tokens)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!b.is_finished(), "needs 2 blocks, only 1 free");
        e.restart();
        drop(a); // an old-generation request releases nothing into the new cache
        assert_eq!(b.await.unwrap(), Ok(0));
        let mut restarts = 0;
        while let Ok(m) = rx.try_recv() {
            restarts += matches!(m, PublishMsg::Restart) as usize;
        }
        assert_eq!(restarts, 1);
        assert_eq!(e.stats().running, 0);
    }
}
