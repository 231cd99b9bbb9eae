//! The route table: the single list of what the backend serves. Dispatch is driven by it and
//! the OpenAPI test compares `openapi.yaml` against it, so the document and the server cannot
//! disagree about which paths and methods exist.

use http::Method;

/// The version segment every path lives under (the interface's base address includes `/v1`).
pub const BASE_PATH: &str = "/v1";

/// The interface's operations, named by their `operationId`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    ListPets,
    CreatePet,
    GetPet,
    ListOrders,
}

impl Operation {
    pub fn id(self) -> &'static str {
        match self {
            Operation::ListPets => "listPets",
            Operation::CreatePet => "createPet",
            Operation::GetPet => "getPet",
            Operation::ListOrders => "listOrders",
        }
    }
}

pub struct Route {
    /// Relative to [`BASE_PATH`], in OpenAPI's template syntax (`{petId}`).
    pub path: &'static str,
    pub methods: &'static [(Method, Operation)],
}

impl Route {
    pub fn allowed(&self) -> Vec<&'static str> {
        self.methods.iter().map(|(m, _)| m.as_str()).collect()
    }
}

pub static ROUTES: &[Route] = &[
    Route {
        path: "/pets",
        methods: &[
            (Method::GET, Operation::ListPets),
            (Method::POST, Operation::CreatePet),
        ],
    },
    Route {
        path: "/pets/{petId}",
        methods: &[(Method::GET, Operation::GetPet)],
    },
    Route {
        path: "/store/orders",
        methods: &[(Method::GET, Operation::ListOrders)],
    },
];

#[derive(Debug, PartialEq, Eq)]
pub enum Resolved<'p> {
    /// The operation, and the raw value of the path's one template parameter, if it has one.
    Found(Operation, Option<&'p str>),
    MethodNotAllowed(&'static Route),
    NotFound,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.path)
    }
}

impl PartialEq for Route {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path
    }
}
impl Eq for Route {}

pub fn resolve<'p>(method: &Method, path: &'p str) -> Resolved<'p> {
    let Some(rest) = path.strip_prefix(BASE_PATH) else {
        return Resolved::NotFound;
    };
    for route in ROUTES {
        let Some(param) = match_template(route.path, rest) else {
            continue;
        };
        return match route.methods.iter().find(|(m, _)| m == method) {
            Some((_, op)) => Resolved::Found(*op, param),
            None => Resolved::MethodNotAllowed(route),
        };
    }
    Resolved::NotFound
}

/// `Some(param)` when `path` fits `template`; a `{…}` segment matches any non-empty segment.
fn match_template<'p>(template: &str, path: &'p str) -> Option<Option<&'p str>> {
    let mut param = None;
    let mut t = template.split('/');
    let mut p = path.split('/');
    loop {
        match (t.next(), p.next()) {
            (None, None) => return Some(param),
            (Some(ts), Some(ps)) if ts.starts_with('{') => {
                if ps.is_empty() {
                    return None;
                }
                param = Some(ps);
            }
            (Some(ts), Some(ps)) if ts == ps => {}
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_every_route_and_nothing_else() {
        use Resolved::*;
        assert_eq!(
            resolve(&Method::GET, "/v1/pets"),
            Found(Operation::ListPets, None)
        );
        assert_eq!(
            resolve(&Method::POST, "/v1/pets"),
            Found(Operation::CreatePet, None)
        );
        assert_eq!(
            resolve(&Method::GET, "/v1/pets/12"),
            Found(Operation::GetPet, Some("12"))
        );
        assert_eq!(
            resolve(&Method::GET, "/v1/pets/abc"),
            Found(Operation::GetPet, Some("abc"))
        );
        assert_eq!(
            resolve(&Method::GET, "/v1/store/orders"),
            Found(Operation::ListOrders, None)
        );
        assert_eq!(
            resolve(&Method::DELETE, "/v1/pets/1"),
            MethodNotAllowed(&ROUTES[1])
        );
        assert_eq!(
            resolve(&Method::PUT, "/v1/pets"),
            MethodNotAllowed(&ROUTES[0])
        );
        for path in [
            "/",
            "/pets",
            "/v1",
            "/v1/",
            "/v1/pets/",
            "/v1/pets/1/x",
            "/v2/pets",
            "/v1/petsx",
            "/v1//pets",
        ] {
            assert_eq!(resolve(&Method::GET, path), NotFound, "{path}");
        }
    }
}
