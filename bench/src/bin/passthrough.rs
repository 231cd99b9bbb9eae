//! A plain pingora pass-through: no authentication, no quota, no headers, no metrics; the same
//! pingora version and runtime settings as pet-gateway (threads, work stealing off, the same
//! upstream keep-alive pool and peer options). The benchmark runs it beside the gateway so that
//! the framework's floor and the gateway's own overhead over it are visible.
//!
//! `passthrough LISTEN UPSTREAM [THREADS]`

use std::net::SocketAddr;
use std::time::Duration;

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::server::configuration::{Opt, ServerConf};

#[global_allocator]
static GLOBAL: proxy::base::alloc::MiMalloc = proxy::base::alloc::MiMalloc;

struct PassThrough {
    upstream: SocketAddr,
}

#[async_trait]
impl ProxyHttp for PassThrough {
    type CTX = ();

    fn new_ctx(&self) -> Self::CTX {}

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        let mut peer = HttpPeer::new(self.upstream, false, String::new());
        peer.options.connection_timeout = Some(Duration::from_secs(2));
        peer.options.total_connection_timeout = Some(Duration::from_secs(2));
        peer.options.read_timeout = Some(Duration::from_secs(10));
        peer.options.write_timeout = Some(Duration::from_secs(10));
        peer.options.idle_timeout = Some(Duration::from_secs(60));
        Ok(Box::new(peer))
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: passthrough LISTEN UPSTREAM [THREADS]");
        std::process::exit(2);
    };
    let Ok(upstream) = upstream.parse::<SocketAddr>() else {
        eprintln!("passthrough: UPSTREAM must be host:port, got {upstream}");
        std::process::exit(2);
    };
    let threads = args.next().and_then(|t| t.parse().ok()).unwrap_or(1);
    let conf = ServerConf {
        threads,
        work_stealing: false,
        upstream_keepalive_pool_size: 128,
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();
    let mut proxy = http_proxy_service(&server.configuration, PassThrough { upstream });
    proxy.add_tcp(&listen);
    server.add_service(proxy);
    server.run_forever();
}
