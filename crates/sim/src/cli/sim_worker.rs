//! `kv-epp-sim sim-worker`: one simulated vLLM worker (OpenAI HTTP API, prefix cache, latency model,
//! KV events over ZeroMQ) from flags, optionally reading the model's block size and LoRA adapters
//! from the same configuration file `serve` reads.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use kv_epp::config::Config;
use kv_epp_sim::api::Served;
use kv_epp_sim::engine::EngineConfig;
use kv_epp_sim::events::{BatchEncoder, EventLayout, HashForm, SimEngine};
use kv_epp_sim::latency::LatencyModel;
use kv_epp_sim::publisher::PublisherConfig;
use kv_epp_sim::server::{self, SimWorkerConfig};

use kv_epp::process::{init_logs, shutdown_signal};

/// Flags of `kv-epp-sim sim-worker`; the event flags mirror vLLM's `--kv-events-config` fields.
#[derive(clap::Args, Debug)]
pub(crate) struct SimWorkerArgs {
    /// HTTP address to bind.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// HTTP port (OpenAI API, /health, /metrics, admin).
    #[arg(long, default_value_t = 8000)]
    pub http_port: u16,
    /// ZeroMQ PUB endpoint the worker binds for KV events.
    #[arg(long, default_value = "tcp://*:5557")]
    pub events_endpoint: String,
    /// ZeroMQ ROUTER endpoint for replay requests (off unless set).
    #[arg(long)]
    pub replay_endpoint: Option<String>,
    /// First frame of every event message.
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Past batches kept for replay.
    #[arg(long, default_value_t = 10_000)]
    pub buffer_steps: usize,
    /// Tokens per KV block (default: the model's block_size in --config-file, else 16).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Blocks in the KV pool.
    #[arg(long, default_value_t = 4096)]
    pub num_blocks: usize,
    /// Which engine to simulate: `vllm`, `sglang` (salted stores carry the salt: array layout as
    /// SGLang #30827, map layout as #37482; SGLang's cache_salt rule on the API) or `trtllm`
    /// (TensorRT-LLM's ZeroMQ publisher: tagged maps, signed hashes, no salt).
    #[arg(long, value_enum, default_value_t = SimEngine::Vllm)]
    pub engine: SimEngine,
    /// Event layout: `map` (vLLM >= 0.26) or `array` (legacy).
    #[arg(long, value_enum, default_value_t = EventLayout::Map)]
    pub event_layout: EventLayout,
    /// Block hashes as `int` (low 64 bits, msgpack uint) or `bytes` (32-byte digest, msgpack bin).
    #[arg(long, value_enum, default_value_t = HashForm::Int)]
    pub hash_form: HashForm,
    /// `data_parallel_rank` of every batch (nil when unset).
    #[arg(long)]
    pub data_parallel_rank: Option<u32>,
    /// Served model name.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// LoRA adapters served on the model, comma-separated (default: the model's
    /// lora_adapters in --config-file).
    #[arg(long, value_delimiter = ',')]
    pub lora_modules: Option<Vec<String>>,
    /// The kv-epp configuration file (as for `serve`).
    #[arg(long)]
    pub config_file: Option<PathBuf>,
    /// Requests running at once; more wait (FIFO).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Fixed cost before each prefill, microseconds.
    #[arg(long, default_value_t = LatencyModel::default().base_us)]
    pub base_us: u64,
    /// Prefill cost per uncached prompt token, microseconds.
    #[arg(long, default_value_t = LatencyModel::default().prefill_us_per_token)]
    pub prefill_us_per_token: f64,
    /// Cost per generated token after the first, microseconds.
    #[arg(long, default_value_t = LatencyModel::default().decode_us_per_token)]
    pub decode_us_per_token: u64,
    /// Share of event batches not published (they keep their sequence number and stay
    /// replayable), 0..=1.
    #[arg(long, default_value_t = 0.0)]
    pub drop_fraction: f64,
    /// Seed of the --drop-fraction decisions.
    #[arg(long, default_value_t = 0)]
    pub fault_seed: u64,
    /// Do not bind the replay socket even when --replay-endpoint is set.
    #[arg(long)]
    pub disable_replay: bool,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    pub log_format: String,
}

/// Builds the worker's configuration from flags and the optional config file.
pub(crate) fn effective_config(args: &SimWorkerArgs) -> Result<SimWorkerConfig, String> {
    let configured = match &args.config_file {
        Some(p) => {
            let c = Config::from_file(p).map_err(|e| e.to_string())?;
            c.validate().map_err(|e| e.to_string())?;
            c.models.into_iter().find(|m| m.name == args.model)
        }
        None => None,
    };
    if let (Some(flag), Some(m)) = (args.block_size, &configured)
        && flag != m.block_size
    {
        // Allowed on purpose (it exercises the router's block-size mismatch handling), but loud.
        tracing::warn!(
            flag,
            configured = m.block_size,
            model = %m.name,
            "--block-size differs from the model's block_size in --config-file; using the flag"
        );
    }
    let block_size = args
        .block_size
        .or(configured.as_ref().map(|m| m.block_size))
        .unwrap_or(16);
    if block_size == 0 || args.num_blocks == 0 || args.max_num_seqs == 0 {
        return Err("--block-size, --num-blocks and --max-num-seqs must be > 0".into());
    }
    if !args.prefill_us_per_token.is_finite() || args.prefill_us_per_token < 0.0 {
        return Err("--prefill-us-per-token must be a finite number >= 0".into());
    }
    let lora_modules: Vec<String> = match (&args.lora_modules, &configured) {
        (Some(l), _) => l.iter().filter(|s| !s.is_empty()).cloned().collect(),
        (None, Some(m)) => m.lora_adapters.clone(),
        (None, None) => Vec::new(),
    };
    if args.model.is_empty() || lora_modules.contains(&args.model) {
        return Err("--model must be non-empty and differ from every LoRA adapter".into());
    }
    Ok(SimWorkerConfig {
        http_addr: SocketAddr::new(args.host, args.http_port),
        served: Served {
            model: args.model.clone(),
            lora_modules: lora_modules.clone(),
            engine: args.engine,
        },
        engine: EngineConfig {
            num_blocks: args.num_blocks,
            block_size,
            max_num_seqs: args.max_num_seqs,
            latency: LatencyModel {
                base_us: args.base_us,
                prefill_us_per_token: args.prefill_us_per_token,
                decode_us_per_token: args.decode_us_per_token,
            },
        },
        publisher: PublisherConfig {
            events_endpoint: args.events_endpoint.clone(),
            replay_endpoint: args
                .replay_endpoint
                .clone()
                .filter(|_| !args.disable_replay),
            topic: args.topic.clone(),
            buffer_steps: args.buffer_steps,
            drop_fraction: args.drop_fraction,
            fault_seed: args.fault_seed,
            encoder: BatchEncoder {
                engine: args.engine,
                layout: args.event_layout,
                hash_form: args.hash_form,
                block_size,
                lora_modules,
                data_parallel_rank: args.data_parallel_rank,
            },
        },
    })
}

/// The tokenizer of the served models (shared code with `serve`), when `--config-file` names
/// tokenizer files: text and chat prompts then get the token IDs vLLM would compute.
fn tokenize_hook(args: &SimWorkerArgs) -> Result<Option<kv_epp_sim::api::TokenizeHook>, String> {
    let Some(path) = &args.config_file else {
        return Ok(None);
    };
    let config = Config::from_file(path).map_err(|e| e.to_string())?;
    if config.models.iter().all(|m| m.tokenizer.is_none()) {
        return Ok(None);
    }
    let models = std::sync::Arc::new(config.served_models().map_err(|e| e.to_string())?);
    Ok(Some(std::sync::Arc::new(
        move |body: &[u8], endpoint: kv_epp_sim::api::Endpoint| {
            let (endpoint, path) = match endpoint {
                kv_epp_sim::api::Endpoint::Chat => (
                    kv_epp_tokenize::Endpoint::ChatCompletions,
                    "/v1/chat/completions",
                ),
                kv_epp_sim::api::Endpoint::Completions => {
                    (kv_epp_tokenize::Endpoint::Completions, "/v1/completions")
                }
            };
            let model = kv_epp_tokenize::parse_request(endpoint, body)
                .map_err(|e| e.to_string())?
                .model;
            let served = models
                .resolve(&model)
                .ok_or_else(|| format!("model `{model}` is not served here"))?;
            served
                .model
                .tokenize(path, body)
                .ok_or_else(|| format!("model `{model}` has no tokenizer"))?
                .map_err(|e| e.to_string())
        },
    )))
}

/// Runs the worker until SIGTERM/Ctrl-C. Prints one line with the bound addresses when ready.
pub(crate) fn run(args: &SimWorkerArgs) -> Result<(), String> {
    init_logs(&args.log_format)?;
    let config = effective_config(args)?;
    let hook = tokenize_hook(args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    rt.block_on(async move {
        let block_size = config.engine.block_size;
        let worker = server::start(config, hook).await?;
        println!(
            "kv-epp-sim sim-worker: http {} events {} replay {} block_size {}",
            worker.http_addr,
            worker.events.events_endpoint,
            worker.events.replay_endpoint.as_deref().unwrap_or("off"),
            block_size
        );
        shutdown_signal().await;
        Ok(())
    })
}
