from qconsole.cli import main

main()
