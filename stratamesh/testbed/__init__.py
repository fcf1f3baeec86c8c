"""Test benches: hosts in network namespaces with emulated links (netbed, link_emulator) and simulated agents by the
thousand (sim), for the tests, the benchmarks and `stratamesh bench`; nothing a mesh in use runs."""
