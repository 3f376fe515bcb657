package requestwebhook

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
)

// The file names of a kubernetes.io/tls Secret (cert-manager's too).
const (
	CertFile = "tls.crt"
	KeyFile  = "tls.key"
)

// certFiles serves the certificate in dir, read again whenever either
// file's modification time or size changes (a Secret volume swaps both at
// once through its ..data symlink; stat follows it). Checked on each TLS
// handshake: two stats, no watcher to keep alive.
type certFiles struct {
	dir string
	log *slog.Logger

	mu    sync.Mutex
	stamp string
	cert  *tls.Certificate
}

func (c *certFiles) get(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	crt, key := filepath.Join(c.dir, CertFile), filepath.Join(c.dir, KeyFile)
	stamp, err := stamps(crt, key)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err == nil && stamp == c.stamp {
		return c.cert, nil
	}
	if err == nil {
		var pair tls.Certificate
		if pair, err = tls.LoadX509KeyPair(crt, key); err == nil {
			if c.cert != nil {
				c.log.Info("certificate reloaded", "dir", c.dir)
			}
			c.stamp, c.cert = stamp, &pair
			return c.cert, nil
		}
	}
	// Mid-rotation (one file new, the other not yet) the pair does not
	// match: keep serving the last good one until both are there.
	if c.cert != nil {
		c.log.Warn("certificate not reloaded; serving the previous one", "dir", c.dir, "err", err)
		return c.cert, nil
	}
	return nil, fmt.Errorf("requestwebhook: certificate in %s: %w", c.dir, err)
}

func stamps(paths ...string) (string, error) {
	s := ""
	for _, p := range paths {
		fi, err := os.Stat(p)
		if err != nil {
			return "", err
		}
		s += fmt.Sprintf("%d/%d;", fi.ModTime().UnixNano(), fi.Size())
	}
	return s, nil
}
