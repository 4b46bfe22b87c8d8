"""Who may see and do what on the Leases page, asked of Airflow's auth manager through its public API.

- **Admins** (:func:`may_force_release`) see every lease and event, those of keys with no DAG included,
  and may force-release. It is asked as an action on the plugin's own resource:
  ``is_authorized_custom_view(method="DELETE", resource_name="Leases")``, the auth manager API for plugin
  views, so FAB and Keycloak deployments grant it like any other permission (FAB: ``can_delete`` on
  ``Leases``, which its Admin role gets once the permission exists). The SimpleAuthManager answers every
  custom-view question as a read that any viewer may do; for it the user's own role must be ``admin``.
- **Everyone else** sees the leases and events of the DAGs they may read
  (``get_authorized_dag_ids(method="GET")``): a lease's DAG is the run its holder's acquire named (its
  ``dag_id`` column), an event's DAG its ``dag_id`` column; no owner string is parsed for it. Keys of no
  run (core API users, scripts) are for admins only: nothing says who else may see them.
- **Force-release** needs an admin *and* edit rights on the lease's DAG
  (``is_authorized_dag(method="PUT")``).

Nothing here is specific to one auth manager but the SimpleAuthManager's role check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from airflow_lease_provider import version_compat

#: The resource name the auth manager is asked about.
RESOURCE_NAME = "Leases"
FORCE_RELEASE_METHOD = "DELETE"


@dataclass(frozen=True)
class Scope:
    """What one user may see: everything (``dag_ids is None``, admins) or the leases of these DAGs."""

    admin: bool
    dag_ids: frozenset[str] | None

    def sees_dag(self, dag_id: str | None) -> bool:
        if self.dag_ids is None:
            return True
        return dag_id is not None and dag_id in self.dag_ids


def may_force_release(auth_manager: Any, user: Any) -> bool:
    """Whether ``user`` is a lease admin, by ``auth_manager`` (an Airflow ``BaseAuthManager``)."""
    if not auth_manager.is_authorized_custom_view(
        method=FORCE_RELEASE_METHOD, resource_name=RESOURCE_NAME, user=user
    ):
        return False
    if isinstance(auth_manager, version_compat.SimpleAuthManager):
        return str(getattr(user, "role", None) or "").upper() == version_compat.SimpleAuthManagerRole.ADMIN.name
    return True


def scope(auth_manager: Any, user: Any) -> Scope:
    """What ``user`` may see on the Leases page and its JSON."""
    if may_force_release(auth_manager, user):
        return Scope(admin=True, dag_ids=None)
    return Scope(admin=False, dag_ids=frozenset(auth_manager.get_authorized_dag_ids(user=user, method="GET")))


def may_read_dag(auth_manager: Any, user: Any, dag_id: str) -> bool:
    details = version_compat.DagDetails(id=dag_id)
    return bool(auth_manager.is_authorized_dag(method="GET", details=details, user=user))


def may_edit_dag(auth_manager: Any, user: Any, dag_id: str) -> bool:
    details = version_compat.DagDetails(id=dag_id)
    return bool(auth_manager.is_authorized_dag(method="PUT", details=details, user=user))
