"""Which tokens the API accepts (services/rollout/openai_api/guards.py): the shared
`services.auth_token`, or with `services.credentials` the roles that `ROLE_METHODS` lets
call the rollout service's Generate; `sha256:<hex>` tokens are digests (hashlib's)."""

from __future__ import annotations

import hashlib

from services.rollout.openai_api.guards import TokenCheck, accepted_digests


def test_shared_token_and_no_auth() -> None:
    check = TokenCheck(accepted_digests("tok", None))
    assert check.allows(b"Bearer tok")
    assert not check.allows(b"Bearer tok2") and not check.allows(None)
    assert not check.allows(b"tok")  # not a bearer header
    assert TokenCheck(accepted_digests(None, None)).allows(None)  # auth off


def test_credentials_accept_roles_that_may_generate() -> None:
    digest = "sha256:" + hashlib.sha256(b"admin-tok").hexdigest()
    creds = {"admin": digest, "launcher": "l-tok", "trainer": "t-tok", "rollout": "r-tok"}
    check = TokenCheck(accepted_digests("shared", creds))
    assert check.allows(b"Bearer admin-tok")
    assert check.allows(b"Bearer l-tok") and check.allows(b"Bearer t-tok")
    assert not check.allows(b"Bearer r-tok")  # rollout may not call Generate
    assert not check.allows(b"Bearer shared")  # credentials replace the shared token
