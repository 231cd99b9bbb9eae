//! The operation a request is for: the only route label metrics and logs ever carry (never a raw
//! path, which a client controls). The names are `openapi.yaml`'s operation ids, and a test
//! (`proxy/tests/openapi_routes.rs`) holds the two together.

use http::Method;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Route {
    ListPets,
    CreatePet,
    GetPet,
    ListOrders,
    /// `GET /v1/rate_limit`, answered by the gateway itself (`quota_status.rs`).
    RateLimit,
    #[default]
    Other,
}

impl Route {
    /// Every operation of the interface, with its method and path template as `openapi.yaml`
    /// writes them (relative to `/v1`).
    pub const OPERATIONS: [(Route, Method, &'static str); 5] = [
        (Route::ListPets, Method::GET, "/pets"),
        (Route::CreatePet, Method::POST, "/pets"),
        (Route::GetPet, Method::GET, "/pets/{petId}"),
        (Route::ListOrders, Method::GET, "/store/orders"),
        (Route::RateLimit, Method::GET, "/rate_limit"),
    ];

    pub fn of(method: &Method, path: &str) -> Route {
        let get = method == Method::GET;
        match path.strip_prefix("/v1") {
            Some("/pets") if get => Route::ListPets,
            Some("/pets") if method == Method::POST => Route::CreatePet,
            Some("/store/orders") if get => Route::ListOrders,
            Some("/rate_limit") if get => Route::RateLimit,
            Some(rest) if get => match rest.strip_prefix("/pets/") {
                Some(id) if !id.is_empty() && !id.contains('/') => Route::GetPet,
                _ => Route::Other,
            },
            _ => Route::Other,
        }
    }

    /// Where this operation's cost is in a plan's `Costs` (`keys::plans::COSTED_OPERATIONS`);
    /// `None` for what costs 1 whatever a plan says (an unknown path) or nothing
    /// (`getRateLimit`).
    /// The route as its template (`/v1/pets/{petId}`); empty for none.
    pub fn template(self) -> &'static str {
        match self {
            Route::ListPets | Route::CreatePet => "/v1/pets",
            Route::GetPet => "/v1/pets/{petId}",
            Route::ListOrders => "/v1/store/orders",
            Route::RateLimit => "/v1/rate_limit",
            Route::Other => "",
        }
    }

    pub fn cost_index(self) -> Option<usize> {
        match self {
            Route::ListPets => Some(0),
            Route::CreatePet => Some(1),
            Route::GetPet => Some(2),
            Route::ListOrders => Some(3),
            Route::RateLimit | Route::Other => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Route::ListPets => "listPets",
            Route::CreatePet => "createPet",
            Route::GetPet => "getPet",
            Route::ListOrders => "listOrders",
            Route::RateLimit => "getRateLimit",
            Route::Other => "other",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_costed_operation_is_its_route() {
        for (i, name) in crate::keys::plans::COSTED_OPERATIONS.iter().enumerate() {
            let route = Route::OPERATIONS
                .iter()
                .map(|(r, _, _)| *r)
                .find(|r| r.as_str() == *name)
                .unwrap_or_else(|| panic!("{name} is no operation"));
            assert_eq!(route.cost_index(), Some(i), "{name}");
        }
        assert_eq!(Route::RateLimit.cost_index(), None);
    }

    #[test]
    fn routes_are_the_operation_names() {
        let get = Method::GET;
        assert_eq!(Route::of(&get, "/v1/pets"), Route::ListPets);
        assert_eq!(Route::of(&Method::POST, "/v1/pets"), Route::CreatePet);
        assert_eq!(Route::of(&get, "/v1/pets/42"), Route::GetPet);
        assert_eq!(Route::of(&get, "/v1/store/orders"), Route::ListOrders);
        for (m, p) in [
            (&get, "/v1/pets/"),
            (&get, "/v1/pets/1/x"),
            (&get, "/admin"),
            (&Method::DELETE, "/v1/pets"),
        ] {
            assert_eq!(Route::of(m, p), Route::Other, "{m} {p}");
        }
    }
}
