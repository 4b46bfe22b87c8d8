"""A leased task whose keeper renews over one held connection ([lease] hold_connection = true, as the tier sets
it): from its second use on that connection the renew statement is sent prepared."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from airflow.sdk import DAG, task

with DAG("held_connection", schedule=None, start_date=datetime(2026, 1, 1)):

    @task.leased(lease_key="held-key", lease_ttl=timedelta(seconds=3))  # renewed every second
    def work(lease=None):
        while lease.keeper.renewals < 3:
            time.sleep(0.2)
            lease.check()
        db = lease.store.db
        renew = db._statement("renew", True, db._conn).prepared.name
        return {
            "renewals": lease.keeper.renewals,
            "held": db.idle_close is None,
            "connects": db.connects,
            "renew_prepared": renew in db._prepared_on,
        }

    work()
