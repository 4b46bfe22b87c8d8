"""Who may force-release a lease: admins, as Airflow's auth manager sees them.

Reading leases needs only a logged-in user (``requires_authenticated``). Force-release frees a lease
whoever holds it, so it is asked of the auth manager as an action on the plugin's own resource:
``is_authorized_custom_view(method="DELETE", resource_name="Leases")``. That is the auth manager API for
plugin views, so FAB and Keycloak deployments grant it like any other permission.

The SimpleAuthManager answers every custom-view question as a read that any viewer may do, whatever
the method; for it the user's own role must be ``admin`` as well.
"""

from __future__ import annotations

from typing import Any

#: The resource name the auth manager is asked about.
RESOURCE_NAME = "Leases"
FORCE_RELEASE_METHOD = "DELETE"


def may_force_release(auth_manager: Any, user: Any) -> bool:
    """Whether ``user`` may force-release leases, by ``auth_manager`` (an Airflow ``BaseAuthManager``)."""
    if not auth_manager.is_authorized_custom_view(
        method=FORCE_RELEASE_METHOD, resource_name=RESOURCE_NAME, user=user
    ):
        return False
    from airflow_lease_provider.version_compat import (
        SimpleAuthManager,
        SimpleAuthManagerRole,
    )

    if isinstance(auth_manager, SimpleAuthManager):
        return str(getattr(user, "role", None) or "").upper() == SimpleAuthManagerRole.ADMIN.name
    return True
