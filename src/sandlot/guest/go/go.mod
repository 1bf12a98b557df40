module sandlot/guest

go 1.19
