/**
 * edgepg-proxy as deployed, for the load and memory tests: `node --import tsx proxy/cli.ts` in a
 * child process, so that the test process (the load generator) does not share its event loop. Its
 * CPU time and resident set are read from /proc; every child is killed when this process exits.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { freePort } from './stack'

const ROOT = fileURLToPath(new URL('../..', import.meta.url))

/** For sessions that all come from 127.0.0.1: lift the proxy's default limits (10,000 in all, 100 per address, half a key's backends per client). */
export const LIFTED_LIMITS = ['--max-sessions', '5000', '--max-sessions-per-ip', '5000', '--max-backends-per-client', '5000', '--shutdown-grace', '0']

export interface ChildProxyOptions {
  /** Node flags, before `--import tsx` (e.g. --expose-gc and a preload). */
  nodeArgs?: string[]
  /** Environment variables, beside this process's. */
  env?: Record<string, string>
  /** edgepg-proxy flags, after --upstream and --listen. */
  flags?: string[]
  /** Run the built CLI (dist/cli.mjs, as the package ships it, or the one named: another build to compare) rather than the TypeScript under tsx: for benchmarks. */
  built?: boolean | string
  /** Sees each line the child writes to stderr first; returning true keeps it out of the error text. */
  onStderrLine?: (line: string) => boolean
}

export interface ChildProxy {
  child: ChildProcess
  pid: number
  port: number
  url: string
  /** The session log lines the proxy has printed so far. */
  logs: Array<{ outcome: string; [key: string]: unknown }>
  /** Every JSON line it has printed so far (with --workers, each worker's and the primary's). */
  lines: Array<Record<string, any>>
  /** CPU seconds (user + system) the child has used so far, from /proc. */
  cpuSeconds(): number
  /** The child's resident set now, from /proc (bytes). */
  rss(): number
  /** SIGTERM, then SIGKILL after 3 s; resolves once the child has exited. */
  stop(): Promise<void>
}

const children = new Set<ChildProcess>()
process.on('exit', () => {
  for (const child of children) child.kill('SIGKILL')
})

export async function startChildProxy(upstream: string, options: ChildProxyOptions = {}): Promise<ChildProxy> {
  const listen = `127.0.0.1:${await freePort()}`
  const { built } = options
  const entry = built ? [typeof built === 'string' ? built : 'dist/cli.mjs'] : ['--import', 'tsx', 'proxy/cli.ts']
  const child = spawn(process.execPath, [...(options.nodeArgs ?? []), ...entry, '--upstream', upstream, '--listen', listen, ...(options.flags ?? [])], {
    cwd: ROOT,
    env: { ...process.env, EDGEPG_WORKERS: '1', ...options.env }, // (one process, unless asked: the tests measure one)
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  children.add(child)
  child.once('exit', () => children.delete(child))
  let stderr = ''
  createInterface({ input: child.stderr! }).on('line', (line) => {
    if (!options.onStderrLine?.(line)) stderr += line + '\n'
  })
  const logs: ChildProxy['logs'] = []
  const lines: ChildProxy['lines'] = []
  const port = await new Promise<number>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`the proxy child did not report listening within 30 s: ${stderr}`)), 30_000)
    child.once('exit', (code) => reject(new Error(`the proxy child exited (code ${code}) before listening: ${stderr}`)))
    // Keep draining stdout for the child's whole life: it logs one line per session.
    createInterface({ input: child.stdout! }).on('line', (line) => {
      let msg: any
      try {
        msg = JSON.parse(line)
      } catch {
        return
      }
      lines.push(msg)
      if (typeof msg.outcome === 'string') logs.push(msg)
      if (msg.listening) {
        clearTimeout(timer)
        resolve(Number(String(msg.listening).split(':').pop()))
      }
    })
  })
  return {
    child,
    pid: child.pid!,
    port,
    url: `ws://127.0.0.1:${port}/v2`,
    logs,
    lines,
    cpuSeconds: () => cpuSecondsOf(child.pid!),
    rss() {
      const status = readFileSync(`/proc/${child.pid}/status`, 'utf8')
      const kb = /^VmRSS:\s+(\d+) kB$/m.exec(status)
      if (!kb) throw new Error(`no VmRSS in /proc/${child.pid}/status`)
      return Number(kb[1]) * 1024
    },
    stop: () => stopChild(child),
  }
}

/** SIGTERM, then SIGKILL if the child is still there after 3 s; resolves once it has exited. */
export function stopChild(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve()
  return new Promise((resolve) => {
    const timer = setTimeout(() => child.kill('SIGKILL'), 3000)
    child.once('exit', () => {
      clearTimeout(timer)
      resolve()
    })
    child.stdin?.end()
    child.kill('SIGTERM')
  })
}

/** A process's CPU time so far (user + system), in seconds, from /proc. */
export function cpuSecondsOf(pid: number): number {
  return procStat(pid).cpuSeconds
}

/** A process's name, parent and CPU seconds (user + system) from /proc/<pid>/stat. */
export function procStat(pid: number): { comm: string; ppid: number; cpuSeconds: number } {
  // Fields after the command name: state is #3, ppid #4; utime #14, stime #15, in ticks of USER_HZ (100 on Linux).
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8')
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ')
  return { comm: stat.slice(stat.indexOf('(') + 1, stat.lastIndexOf(')')), ppid: Number(fields[1]), cpuSeconds: (Number(fields[11]) + Number(fields[12])) / 100 }
}

/** Preload for the child: on SIGUSR2, a full GC, then one JSON line of process.memoryUsage(). */
const GC_PRELOAD =
  'data:text/javascript,' +
  encodeURIComponent(`process.on('SIGUSR2', () => { globalThis.gc(); process.stderr.write(JSON.stringify({ memoryAfterGc: process.memoryUsage() }) + '\\n') })`)

export type MemoryUsage = ReturnType<typeof process.memoryUsage>

export interface GcProxy extends ChildProxy {
  /** Runs a full GC in the child and returns its process.memoryUsage() right after. */
  memoryAfterGc(): Promise<MemoryUsage>
}

/**
 * A proxy child whose memory can be measured after a full GC, without changing the proxy: it runs
 * with --expose-gc and a preload (a data: URL) that answers SIGUSR2.
 */
export async function startGcProxy(upstream: string, flags: string[], env?: Record<string, string>, built?: boolean): Promise<GcProxy> {
  const gcWaiters: Array<(m: MemoryUsage) => void> = []
  const proxy = await startChildProxy(upstream, {
    nodeArgs: ['--expose-gc', '--import', GC_PRELOAD],
    flags,
    env,
    built,
    onStderrLine(line) {
      if (!line.startsWith('{"memoryAfterGc"')) return false
      gcWaiters.shift()?.(JSON.parse(line).memoryAfterGc)
      return true
    },
  })
  return Object.assign(proxy, {
    memoryAfterGc() {
      return new Promise<MemoryUsage>((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error('the proxy child did not answer a GC request within 10 s')), 10_000)
        gcWaiters.push((m) => {
          clearTimeout(timer)
          resolve(m)
        })
        proxy.child.kill('SIGUSR2')
      })
    },
  })
}
