package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"syscall"
	"time"
	"unsafe"
)

// configureNetwork does what `ip link set lo up; ip link set eth0 up; ip addr add
// 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2` did, with rtnetlink (an image may
// have no iproute2); if netlink fails and `ip` is there, that is tried instead.
func configureNetwork() error {
	err := netlinkSetup()
	if err == nil {
		return nil
	}
	if _, lookErr := exec.LookPath("ip"); lookErr != nil {
		return err
	}
	logf("netlink: %v; trying ip", err)
	for _, args := range [][]string{{"link", "set", "lo", "up"}, {"link", "set", "eth0", "up"},
		{"addr", "add", fmt.Sprintf("%s/%d", guestIP, prefixLen), "dev", "eth0"},
		{"route", "add", "default", "via", gateway}} {
		cmd := exec.Command("ip", args...)
		cmd.Stdout, cmd.Stderr = nil, nil
		cmd.Run()
	}
	return nil
}

func netlinkSetup() error {
	lo, err := interfaceIndex("lo")
	if err != nil {
		return err
	}
	eth, err := interfaceIndex("eth0")
	if err != nil {
		return err
	}
	nl, err := openNetlink()
	if err != nil {
		return err
	}
	defer syscall.Close(nl.fd)
	for _, index := range []int32{lo, eth} {
		msg := syscall.IfInfomsg{Family: syscall.AF_UNSPEC, Index: index,
			Flags: syscall.IFF_UP, Change: syscall.IFF_UP}
		if err := nl.request(syscall.RTM_NEWLINK, 0, structBytes(&msg), nil); err != nil {
			return fmt.Errorf("link %d up: %w", index, err)
		}
	}
	ip := net.ParseIP(guestIP).To4()
	addr := syscall.IfAddrmsg{Family: syscall.AF_INET, Prefixlen: prefixLen,
		Scope: syscall.RT_SCOPE_UNIVERSE, Index: uint32(eth)}
	if err := nl.request(syscall.RTM_NEWADDR, syscall.NLM_F_CREATE|syscall.NLM_F_EXCL,
		structBytes(&addr), []attr{{syscall.IFA_LOCAL, ip}, {syscall.IFA_ADDRESS, ip}}); err != nil &&
		!errors.Is(err, syscall.EEXIST) {
		return fmt.Errorf("address: %w", err)
	}
	route := syscall.RtMsg{Family: syscall.AF_INET, Table: syscall.RT_TABLE_MAIN,
		Protocol: syscall.RTPROT_BOOT, Scope: syscall.RT_SCOPE_UNIVERSE,
		Type: syscall.RTN_UNICAST}
	if err := nl.request(syscall.RTM_NEWROUTE, syscall.NLM_F_CREATE|syscall.NLM_F_EXCL,
		structBytes(&route), []attr{{syscall.RTA_GATEWAY, net.ParseIP(gateway).To4()}}); err != nil &&
		!errors.Is(err, syscall.EEXIST) {
		return fmt.Errorf("default route: %w", err)
	}
	return nil
}

// interfaceIndex waits briefly for the interface (the NIC's driver was loaded just before).
func interfaceIndex(name string) (int32, error) {
	var err error
	for i := 0; i < 100; i++ {
		var iface *net.Interface
		if iface, err = net.InterfaceByName(name); err == nil {
			return int32(iface.Index), nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return 0, fmt.Errorf("interface %s: %w", name, err)
}

type attr struct {
	kind uint16
	data []byte
}

type netlink struct {
	fd  int
	seq uint32
}

func openNetlink() (*netlink, error) {
	fd, err := syscall.Socket(syscall.AF_NETLINK, syscall.SOCK_RAW|syscall.SOCK_CLOEXEC,
		syscall.NETLINK_ROUTE)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrNetlink{Family: syscall.AF_NETLINK}); err != nil {
		syscall.Close(fd)
		return nil, os.NewSyscallError("bind", err)
	}
	return &netlink{fd: fd}, nil
}

func align4(n int) int { return (n + 3) &^ 3 }

// structBytes is a kernel struct's bytes in the machine's own byte order, as rtnetlink wants.
func structBytes[T any](v *T) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v))
}

// request sends one rtnetlink request and waits for its acknowledgement.
func (nl *netlink) request(kind uint16, flags uint16, body []byte, attrs []attr) error {
	nl.seq++
	msg := make([]byte, syscall.NLMSG_HDRLEN+align4(len(body)))
	copy(msg[syscall.NLMSG_HDRLEN:], body)
	for _, a := range attrs {
		rta := syscall.RtAttr{Len: uint16(syscall.SizeofRtAttr + len(a.data)), Type: a.kind}
		b := make([]byte, align4(int(rta.Len)))
		copy(b, structBytes(&rta))
		copy(b[syscall.SizeofRtAttr:], a.data)
		msg = append(msg, b...)
	}
	hdr := syscall.NlMsghdr{Len: uint32(len(msg)), Type: kind,
		Flags: syscall.NLM_F_REQUEST | syscall.NLM_F_ACK | flags, Seq: nl.seq}
	copy(msg, structBytes(&hdr))
	if err := syscall.Sendto(nl.fd, msg, 0, &syscall.SockaddrNetlink{
		Family: syscall.AF_NETLINK}); err != nil {
		return os.NewSyscallError("sendto", err)
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := syscall.Recvfrom(nl.fd, buf, 0)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return os.NewSyscallError("recvfrom", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Seq != nl.seq || m.Header.Type != syscall.NLMSG_ERROR {
				continue
			}
			if len(m.Data) < 4 {
				return errors.New("short netlink error message")
			}
			code := *(*int32)(unsafe.Pointer(&m.Data[0]))
			if code == 0 {
				return nil
			}
			return syscall.Errno(-code)
		}
	}
}
