//! The `log` facade over Envoy's logger (`dynamic_modules` logger id), so the core's log
//! lines land in Envoy's log as the wasm build's do. The level follows Envoy's, read at load
//! and at every configuration, so a disabled level costs one comparison.

use crate::abi::{self, log_level, ModuleBuffer};
use log::{Level, LevelFilter, Log, Metadata, Record};

struct EnvoyLogger;

static LOGGER: EnvoyLogger = EnvoyLogger;

fn envoy_level(level: Level) -> abi::LogLevel {
    match level {
        Level::Error => log_level::ERROR,
        Level::Warn => log_level::WARN,
        Level::Info => log_level::INFO,
        Level::Debug => log_level::DEBUG,
        Level::Trace => log_level::TRACE,
    }
}

impl Log for EnvoyLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let line = record.args().to_string();
        let message = ModuleBuffer { ptr: line.as_ptr().cast(), length: line.len() };
        // SAFETY: the buffer is lent for the call; Envoy copies it.
        unsafe { abi::envoy_dynamic_module_callback_log(envoy_level(record.level()), message) };
    }

    fn flush(&self) {}
}

/// Installs the logger (once per process; later calls only refresh the level).
pub fn init() {
    let _ = log::set_logger(&LOGGER);
    follow_envoy_level();
}

/// Sets the facade's level to Envoy's `dynamic_modules` logger level.
pub fn follow_envoy_level() {
    // SAFETY: no arguments; callable from any thread.
    let level = unsafe { abi::envoy_dynamic_module_callback_get_log_level() };
    log::set_max_level(match level {
        log_level::TRACE => LevelFilter::Trace,
        log_level::DEBUG => LevelFilter::Debug,
        log_level::INFO => LevelFilter::Info,
        log_level::WARN => LevelFilter::Warn,
        log_level::ERROR | log_level::CRITICAL => LevelFilter::Error,
        _ => LevelFilter::Off,
    });
}
