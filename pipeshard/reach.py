"""Why a fleet member cannot reach another, in one line that names the fix.

gRPC reports a failed dial as UNAVAILABLE with its transport's words ("Connection refused",
"Peer name ... is not in peer certificate", ...); a stage or coordinator started on another
host turns them into the step its operator takes next instead of waiting in silence.
"""

from __future__ import annotations

# (words gRPC's details hold, what the operator does about it); the first match wins.
_CAUSES = (
    (
        ("hostname verification", "peer name", "not in peer certificate", "hostname mismatch"),
        "its certificate is not made for {host}: make it again with `pipeshard certs` naming that "
        "host, or dial it by a name its certificate holds",
    ),
    (
        ("certificate_verify_failed", "certificate verify failed", "unknown ca", "self signed"),
        "its certificate is from another fleet's CA: copy this fleet's ca.pem and certificates "
        "(one `pipeshard certs` folder) to both hosts",
    ),
    (
        ("wrong_version_number", "record layer failure", "handshake failed", "ssl"),
        "TLS on one side only: give both the same --tls-dir, or neither",
    ),
    (
        ("connection refused",),
        "nothing listens on port {port} of {host}: start it there, or fix the address",
    ),
    (
        ("name resolution", "dns resolution", "could not resolve", "not known"),
        "{host} is not a known host name: use its address, or add it to /etc/hosts",
    ),
)
_DEFAULT = "no answer from {host}:{port}: check it runs and that its firewall lets port {port} in"


def is_tls_failure(details: str) -> bool:
    """Whether a failed dial was refused by TLS (retrying will not help) rather than unanswered."""
    low = details.lower()
    return any(w in low for words, _ in _CAUSES[:3] for w in words)


def unreachable_hint(role: str, address: str, details: str) -> str:
    """One line: ``role`` at ``address`` cannot be reached, why (from gRPC's ``details``), and the fix."""
    host, _, port = address.rpartition(":")
    low = details.lower()
    fix = next((fix for words, fix in _CAUSES if any(w in low for w in words)), _DEFAULT)
    return f"cannot reach the {role} at {address}: " + fix.format(host=host, port=port, role=role)
