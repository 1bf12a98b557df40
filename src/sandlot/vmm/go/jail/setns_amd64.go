package main

const sysSetns = 308 // setns(2) on amd64 (not in Go 1.19's syscall package)
