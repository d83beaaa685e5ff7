"""A fleet's state directory beyond ``FleetState`` / ``load_state`` (the door's ``records``): one server's record
(``ServerRecord``), the token a client sends (``fleet_token``, ``TOKEN_ENV``), the check that no fleet runs there
yet (``check_state_dir``) and one state listing the servers of several (``merge_states``).

One name on the door for what ``offgrpo fleet`` and the trainer-side client read of that directory; each lives in
its own module.
"""

from megatron_offgrpo.fleet._auth import TOKEN_ENV
from megatron_offgrpo.fleet._claim import check_state_dir
from megatron_offgrpo.fleet._merge import merge_states
from megatron_offgrpo.fleet._state import ServerRecord, fleet_token

__all__ = ["TOKEN_ENV", "ServerRecord", "check_state_dir", "fleet_token", "merge_states"]
