from hsstream.cli import main

main()
