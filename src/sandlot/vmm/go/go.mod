module sandlot/host

go 1.19
