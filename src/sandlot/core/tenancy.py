"""Tenants: who a request acts for, and what it may see.

Every sandbox, snapshot and pause belongs to a tenant (a team of API keys). A key acts for
its tenant and sees that tenant's objects only; another tenant's object is answered exactly
as a missing one. Admin keys (the operators', e.g. SANDLOT_API_KEY) see every tenant's.
Core checks this at its door: every public call that names an object takes a `Principal`.
"""

from __future__ import annotations

from dataclasses import dataclass

OPERATOR_TENANT = "operator"  # the tenant of admin keys, and of records made before tenants


@dataclass(frozen=True)
class Principal:
    """Who a call acts for: a tenant, and whether it is an admin (sees every tenant)."""

    tenant: str
    admin: bool = False

    def sees(self, owner: str | None) -> bool:
        """Whether an object of tenant `owner` is visible (None: made before tenants)."""
        return self.admin or (owner or OPERATOR_TENANT) == self.tenant


def tenant_of(owner: str | None) -> Principal:
    """Who a credential of one sandbox (an envd access token, a traffic token, a URL signed
    with it) acts for: the tenant that owns the sandbox (`owner`, as its record has it)."""
    return Principal(owner or OPERATOR_TENANT)


# Calls core makes on its own behalf (the reaper, recovery, auto-resume, a peer's placement).
SYSTEM = Principal(OPERATOR_TENANT, admin=True)
# Sees nothing: a credential of a sandbox that does not run here.
NOBODY = Principal("")
