from raysim.cli import console_main

console_main()
