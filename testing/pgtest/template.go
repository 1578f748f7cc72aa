package pgtest

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
)

// templateMu keeps this process's tests from making the template twice;
// other processes race through the rename in templateCluster.
var templateMu sync.Mutex

// templateCluster returns a cluster initdb made with initdbArgs for the
// installation in bin, kept in the user's cache directory and shared by
// every test process: made once, then copied for each server. The cache is
// named after the installation (initdb's path, size and time), so an
// upgraded PostgreSQL gets a new one.
func templateCluster(bin string, cred *syscall.Credential) (string, error) {
	templateMu.Lock()
	defer templateMu.Unlock()
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	fi, err := os.Stat(filepath.Join(bin, "initdb"))
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(fmt.Appendf(nil, "%s\x00%d\x00%d\x00%s", bin, fi.Size(), fi.ModTime().UnixNano(), strings.Join(initdbArgs, "\x00")))
	root := filepath.Join(cache, "leasehold-pgtest")
	tpl := filepath.Join(root, hex.EncodeToString(sum[:8]))
	if _, err := os.Stat(filepath.Join(tpl, "PG_VERSION")); err == nil {
		return tpl, nil
	}
	// initdb runs as the server's user, which may not reach the cache (a
	// root's home): it writes in a temporary directory, and the cache
	// takes a copy, complete before its rename makes it visible.
	work, err := os.MkdirTemp("", "pgtest-template-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(work)
	if err := os.Mkdir(filepath.Join(work, "data"), 0o700); err != nil {
		return "", err
	}
	if cred != nil {
		for _, p := range []string{work, filepath.Join(work, "data")} {
			if err := os.Chown(p, int(cred.Uid), int(cred.Gid)); err != nil {
				return "", err
			}
		}
	}
	if err := initdb(bin, work, cred); err != nil {
		return "", err
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(root, "new-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	if err := copyTree(filepath.Join(work, "data"), filepath.Join(tmp, "data"), nil); err != nil {
		return "", err
	}
	if err := os.Rename(filepath.Join(tmp, "data"), tpl); err != nil {
		// Another process made it first.
		if _, serr := os.Stat(filepath.Join(tpl, "PG_VERSION")); serr == nil {
			return tpl, nil
		}
		return "", err
	}
	return tpl, nil
}

// copyTree copies the directories and regular files under src to dst
// (which may exist, empty), keeping their modes, owned by cred's user
// when cred is set.
func copyTree(src, dst string, cred *syscall.Credential) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		to := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			if err := os.Mkdir(to, info.Mode().Perm()); err != nil && !(rel == "." && os.IsExist(err)) {
				return err
			}
		case info.Mode().IsRegular():
			if err := copyFile(path, to, info.Mode().Perm()); err != nil {
				return err
			}
		default:
			return fmt.Errorf("pgtest: %s: not a directory or a regular file", path)
		}
		if cred != nil {
			return os.Chown(to, int(cred.Uid), int(cred.Gid))
		}
		return nil
	})
}

func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
