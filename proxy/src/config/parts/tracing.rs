//! OpenTelemetry traces: where spans go and how many requests are sampled.

use crate::config::model::{ConfigError, SampleRatio};
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Value};

const TRACING_OTLP_ENDPOINT: Setting<String> = Setting::new(
    "tracing_otlp_endpoint",
    Kind::Text,
    Preset::Absent(
        "none: the SDK's `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` \
         when set, else no traces",
    ),
    "the OTLP collector's traces URL (HTTP/protobuf, as `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: \
     `http://collector:4318/v1/traces`); spans of sampled requests go there in batches from a \
     bounded queue, never waited for. The SDK's other variables apply (`OTEL_EXPORTER_OTLP_HEADERS`, \
     `_TIMEOUT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`; `OTEL_SDK_DISABLED=true` turns \
     traces off)",
    |v| {
        let url = v.text()?;
        if url.starts_with("http://") || url.starts_with("https://") {
            Ok(url)
        } else {
            Err(format!("`{url}` must start with http:// or https://"))
        }
    },
)
.value_name("URL");
const TRACING_SAMPLE_RATIO: Setting<SampleRatio> = Setting::new(
    "tracing_sample_ratio",
    Kind::Number,
    Preset::Value("0.01"),
    "the share of requests traced (0 to 1), by their trace id, where no caller in \
     `trusted_proxies` sent a `traceparent` whose sampled flag decides (parent-based)",
    ratio,
)
.value_name("RATIO");

pub const SETTINGS: &[Row] = &[TRACING_OTLP_ENDPOINT.row, TRACING_SAMPLE_RATIO.row];

pub struct Tracing {
    pub endpoint: Option<String>,
    pub sample_ratio: SampleRatio,
}

pub fn validate(l: &Layers) -> Result<Tracing, ConfigError> {
    Ok(Tracing {
        endpoint: l.get(&TRACING_OTLP_ENDPOINT)?.map(|s| s.value),
        sample_ratio: l.value(&TRACING_SAMPLE_RATIO)?,
    })
}

fn ratio(v: Value) -> Result<SampleRatio, String> {
    let text = v.text()?;
    match text.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(SampleRatio(r)),
        _ => Err(format!("`{text}` is not a ratio from 0 to 1")),
    }
}
