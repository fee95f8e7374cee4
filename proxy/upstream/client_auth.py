"""What a client's ``Authorization`` header becomes upstream (``auth.forward_client_authorization``).

The default, ``never``, is the safe one: a client's credential was presented to the gateway,
and a gateway that passes it on hands it to whichever backend the router picked, including
discovered pods the client never knew of and servers run by someone else; the backend sees
only the operator's own ``backends[].api_key`` (or URL user:pass), or nothing.

``when_no_backend_key`` is the transparent-proxy setting (kvroute's behaviour before the key
existed): clients hold the backends' keys, and the gateway passes them to backends that have
no key of their own. ``always`` passes the client's header to every backend, in place of the
backend's key when the client sent one (per-user keys that the servers check themselves).
With ``auth.api_keys`` the header holds a gateway key, so only ``never`` is accepted (config
validation, proxy.config.serving).
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.config import AuthConfig


def strips_client_authorization(auth: AuthConfig) -> bool:
    """True when the client's ``Authorization`` must not leave the gateway."""
    return bool(auth.api_keys) or auth.forward_client_authorization == "never"


def upstream_credential(
    auth: AuthConfig, headers: Mapping[str, str], backend_credential: str | None
) -> str | None:
    """The credential to put in place of the forwarded headers' ``Authorization``, if any."""
    if auth.forward_client_authorization == "always" and any(
        k.lower() == "authorization" for k in headers
    ):
        return None
    return backend_credential
