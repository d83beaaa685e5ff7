"""``torchrun --nproc_per_node N -m megatron_offgrpo.train --config RECIPE [key=value ...]``."""

from megatron_offgrpo.train.cli_entry import main

if __name__ == "__main__":
    main()
