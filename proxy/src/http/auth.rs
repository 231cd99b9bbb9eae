//! The bearer credential: `Authorization: Bearer <API_KEY>` (RFC 6750). Parsing is strict and
//! bounded, because this is the first thing the gateway reads from anyone on the internet.

/// Longer tokens are refused before they are hashed; ours are 68 characters.
pub const MAX_TOKEN_LEN: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    Missing,
    Malformed,
    /// Shaped like one of our keys, but its checksum does not match (counted as malformed).
    Checksum,
    Unknown,
    /// A key past its `expires_at`.
    Expired,
}

impl AuthFailure {
    /// For logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing",
            AuthFailure::Malformed | AuthFailure::Checksum => "malformed",
            AuthFailure::Unknown => "unknown",
            AuthFailure::Expired => "expired",
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            AuthFailure::Missing => "an API key is required: send Authorization: Bearer <API_KEY>",
            AuthFailure::Malformed => "the Authorization header must be: Bearer <API_KEY>",
            AuthFailure::Checksum => {
                "the API key is malformed: its checksum does not match (mistyped or cut short?)"
            }
            AuthFailure::Unknown => "the API key is not valid",
            AuthFailure::Expired => "the API key has expired",
        }
    }
}

/// Extracts the token from the `Authorization` header values of a request (all of them: more
/// than one is malformed, not "take the first").
pub fn bearer_token<'a, I>(mut values: I) -> Result<&'a str, AuthFailure>
where
    I: Iterator<Item = &'a [u8]>,
{
    let value = values.next().ok_or(AuthFailure::Missing)?;
    if values.next().is_some() {
        return Err(AuthFailure::Malformed);
    }
    let value = std::str::from_utf8(value).map_err(|_| AuthFailure::Malformed)?;
    let (scheme, rest) = value.split_once(' ').ok_or(AuthFailure::Malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthFailure::Malformed);
    }
    let token = rest.trim_matches(' ');
    if token.is_empty() || token.len() > MAX_TOKEN_LEN || !is_token68(token) {
        return Err(AuthFailure::Malformed);
    }
    Ok(token)
}

/// RFC 7235 token68: `1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="`.
fn is_token68(s: &str) -> bool {
    let body = s.trim_end_matches('=');
    !body.is_empty() && body.bytes().all(|b| TOKEN68[usize::from(b)])
}

/// token68's characters, by byte: one load a byte, where the comparisons cost some 600
/// instructions for a key's 68 characters on every request.
static TOKEN68: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] =
            c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~' | b'+' | b'/');
        b += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(values: &[&[u8]]) -> Result<&'static str, AuthFailure> {
        let owned: Vec<&'static [u8]> = values
            .iter()
            .map(|v| &*Box::leak(v.to_vec().into_boxed_slice()))
            .collect();
        bearer_token(owned.into_iter())
    }

    #[test]
    fn the_token68_table_is_the_rules() {
        for b in 0..=255u8 {
            let rule =
                b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/');
            assert_eq!(TOKEN68[usize::from(b)], rule, "{b}");
        }
    }

    #[test]
    fn accepts_bearer_tokens_in_any_scheme_case() {
        assert_eq!(parse(&[b"Bearer pet_abc123"]), Ok("pet_abc123"));
        assert_eq!(parse(&[b"bearer   pet_abc123  "]), Ok("pet_abc123"));
        assert_eq!(parse(&[b"BEARER a+b/c=="]), Ok("a+b/c=="));
    }

    #[test]
    fn refuses_everything_else() {
        assert_eq!(parse(&[]), Err(AuthFailure::Missing));
        let long = format!("Bearer {}", "a".repeat(MAX_TOKEN_LEN + 1));
        for bad in [
            &b"Basic dXNlcjpwYXNz"[..],
            b"Bearer",
            b"Bearer ",
            b"Bearerpet_abc",
            b"Bearer pet abc",
            b"Bearer pet\x01abc",
            b"Bearer p\xc3\xa9t",
            b"Bearer \xff\xfe",
            b"Bearer ==",
            long.as_bytes(),
        ] {
            assert_eq!(parse(&[bad]), Err(AuthFailure::Malformed), "{bad:?}");
        }
        assert_eq!(
            parse(&[b"Bearer a", b"Bearer b"]),
            Err(AuthFailure::Malformed)
        );
    }
}
