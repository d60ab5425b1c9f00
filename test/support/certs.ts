/**
 * Test certificates, generated at test time with the openssl CLI: P-256 ECDSA throughout, which is
 * what subtls verifies (ECDSA P-256 + SHA-256 for the server's CertificateVerify and the chain).
 *
 * subtls's own requirements shape the extensions: the leaf needs a DNS subjectAltName (subtls
 * matches DNS names only, never IP SANs), serverAuth EKU and must be valid now; every signing (CA)
 * certificate needs basicConstraints CA:TRUE *and* digitalSignature in its keyUsage; a leaf's
 * authorityKeyIdentifier is how subtls finds its CA among the trusted roots.
 */
import { execFile } from 'node:child_process'
import { X509Certificate } from 'node:crypto'
import tls from 'node:tls'
import { mkdtemp, readFile, rm, writeFile, mkdir } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { promisify } from 'node:util'

const run = promisify(execFile)

export interface CertFiles {
  /** PEM of the certificate. */
  cert: string
  /** PEM of its private key. */
  key: string
  certFile: string
  keyFile: string
}

export interface TestCerts {
  dir: string
  /** The CA clients trust (its PEM is what goes into `rootCerts`). */
  ca: CertFiles
  /** An unrelated CA: trusting only it, the good server certificate has an unknown CA. */
  otherCa: CertFiles
  /** `localhost` + IP 127.0.0.1, signed by `ca`, valid now. */
  server: CertFiles
  /** `db.example.com` only, signed by `ca`, valid now. */
  wrongHost: CertFiles
  /** `localhost`, signed by `ca`, valid only during 2020. */
  expired: CertFiles
  /** Removes the temp dir. */
  cleanup(): Promise<void>
}

const openssl = async (cwd: string, ...args: string[]) => {
  try {
    await run('openssl', args, { cwd })
  } catch (err: any) {
    throw new Error(`openssl ${args.join(' ')} failed: ${err.stderr || err.message}`)
  }
}

const CA_EXT = `[req]
distinguished_name = dn
prompt = no
[dn]
CN = placeholder
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
`

const leafExt = (sans: string) => `basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = ${sans}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
`

export async function generateCerts(): Promise<TestCerts> {
  const dir = await mkdtemp(join(tmpdir(), 'edgepg-certs-'))
  const path = (name: string) => join(dir, name)
  await writeFile(path('ca.cnf'), CA_EXT)

  const key = (name: string) => openssl(dir, 'genpkey', '-algorithm', 'EC', '-pkeyopt', 'ec_paramgen_curve:P-256', '-out', `${name}.key`)

  const makeCa = async (name: string, cn: string) => {
    await key(name)
    await openssl(dir, 'req', '-x509', '-new', '-config', 'ca.cnf', '-extensions', 'v3_ca', '-key', `${name}.key`, '-sha256', '-days', '3650', '-subj', `/CN=${cn}`, '-out', `${name}.crt`)
  }

  /** A CSR for a leaf; signed below by `x509 -req` (valid now) or `ca` (explicit past dates). */
  const csr = async (name: string, cn: string) => {
    await key(name)
    await openssl(dir, 'req', '-new', '-config', 'ca.cnf', '-key', `${name}.key`, '-subj', `/CN=${cn}`, '-out', `${name}.csr`)
  }

  let serial = 1000
  const signNow = async (name: string, cn: string, sans: string) => {
    await csr(name, cn)
    await writeFile(path(`${name}.ext`), leafExt(sans))
    await openssl(dir, 'x509', '-req', '-in', `${name}.csr`, '-CA', 'ca.crt', '-CAkey', 'ca.key', '-set_serial', String(serial++), '-days', '365', '-sha256', '-extfile', `${name}.ext`, '-out', `${name}.crt`)
  }

  // OpenSSL 3.0's `x509` has no -not_before/-not_after (added in 3.4), so the expired certificate
  // comes from `openssl ca`, which takes explicit -startdate/-enddate.
  const signExpired = async (name: string, cn: string, sans: string) => {
    await csr(name, cn)
    await writeFile(path(`${name}.ext`), leafExt(sans))
    await mkdir(path('newcerts'))
    await writeFile(path('index.txt'), '')
    await writeFile(path('serial'), '2000\n')
    await writeFile(
      path('sign.cnf'),
      `[ca]
default_ca = edgepg
[edgepg]
database = ${path('index.txt')}
new_certs_dir = ${path('newcerts')}
serial = ${path('serial')}
certificate = ${path('ca.crt')}
private_key = ${path('ca.key')}
default_md = sha256
policy = anything
unique_subject = no
copy_extensions = none
[anything]
commonName = supplied
`
    )
    await openssl(dir, 'ca', '-batch', '-notext', '-config', 'sign.cnf', '-startdate', '200101000000Z', '-enddate', '201231235959Z', '-extfile', `${name}.ext`, '-in', `${name}.csr`, '-out', `${name}.crt`)
  }

  await Promise.all([makeCa('ca', 'edgepg test CA'), makeCa('other-ca', 'edgepg unrelated CA')])
  await Promise.all([
    signNow('server', 'localhost', 'DNS:localhost, IP:127.0.0.1'),
    signNow('wrong-host', 'db.example.com', 'DNS:db.example.com'),
    signExpired('expired', 'localhost', 'DNS:localhost, IP:127.0.0.1'),
  ])

  const load = async (name: string): Promise<CertFiles> => ({
    cert: await readFile(path(`${name}.crt`), 'utf8'),
    key: await readFile(path(`${name}.key`), 'utf8'),
    certFile: path(`${name}.crt`),
    keyFile: path(`${name}.key`),
  })
  return {
    dir,
    ca: await load('ca'),
    otherCa: await load('other-ca'),
    server: await load('server'),
    wrongHost: await load('wrong-host'),
    expired: await load('expired'),
    cleanup: () => rm(dir, { recursive: true, force: true }),
  }
}

/** The certificate (its SHA-256 fingerprint) a TLS server on 127.0.0.1 presents right now for `localhost`. */
export function presented(port: number, ca: string) {
  return new Promise<string>((resolve, reject) => {
    const s = tls.connect({ host: '127.0.0.1', port, ca, servername: 'localhost' }, () => {
      resolve(new X509Certificate(s.getPeerCertificate(true).raw).fingerprint256)
      s.end()
    })
    s.once('error', reject)
  })
}
