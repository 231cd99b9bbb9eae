//! `POST /reload`: the keys and plans reloaded now, and what each part did.

use std::sync::Arc;

use http::Response;

use super::reply::{error, json_response};
use super::Admin;
use crate::http::responses::ErrorCode;

impl Admin {
    pub(super) async fn reload(&self) -> Response<Vec<u8>> {
        let catalog = Arc::clone(&self.catalog);
        let reloaded = tokio::task::spawn_blocking(move || {
            let report = catalog.reload(false).to_json();
            let mut state = catalog.state();
            if let (Some(state), serde_json::Value::Object(report)) =
                (state.as_object_mut(), report)
            {
                state.extend(report);
            }
            state
        })
        .await;
        match reloaded {
            Ok(answer) => json_response(200, answer.to_string().into_bytes()),
            Err(e) => error(500, ErrorCode::Internal, &format!("reload failed: {e}")),
        }
    }
}
