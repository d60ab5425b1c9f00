/**
 * `--workers n`: one listening backend per pool key for the whole proxy, held by the primary
 * (issue 50). Each worker's hub (proxy/notify/hub.ts) listens through it as one subscriber: a
 * notification crosses IPC once per worker with a session on its channel, and each worker writes
 * it to its own sessions, so the fan-out runs on every core and Postgres sees one backend. It lives
 * as long as the primary: a worker replaced (a handover) or lost costs the others' sessions nothing.
 *
 * The primary logs it in with what a key's first login told the workers (a KeyMessage), as a worker
 * logs in a key's backends ahead of need.
 */
import { Hub, type Subscriber } from '../notify/hub'
import type { ListenerEvents, ListeningBackend, Notification } from '../notify/listener'
import { loginAs, passedLogin } from '../login/in-upgrade'
import { ready } from '../pool/lenders'
import type { UpstreamTls } from '../upstream/connection'
import type { HostPort } from '../upstream/address'

export type ListenToPrimary =
  | { edgepg: 'listen'; op: 'listen'; key: string; channel: string; id: number }
  | { edgepg: 'listen'; op: 'unlisten'; key: string; channel: string }
  /** The worker's hub for `key` listens on nothing more. */
  | { edgepg: 'listen'; op: 'close'; key: string }

export type ListenToWorker =
  | { edgepg: 'listen'; op: 'listened'; id: number; error?: { message: string; code?: string } }
  | { edgepg: 'listen'; op: 'note'; key: string; pid: number; channel: string; payload: string }
  | { edgepg: 'listen'; op: 'lost'; key: string; message: string }
  | { edgepg: 'listen'; op: 'restored'; key: string }

/** A key's login, as a worker passes it on (its KeyMessage, proxy/cluster/worker.ts). */
type KeyLogin = { key: string; target: HostPort } & Parameters<typeof passedLogin>[0]

/** Logins of keys no hub uses that the primary keeps (a key's first login in any worker names it again). */
const LOGINS_KEPT = 1000

/** The primary's part: each key's hub, with a subscriber for each worker listening through it. */
export class ListeningKeeper {
  private readonly logins = new Map<string, KeyLogin>()
  private readonly hubs = new Map<string, Hub>()
  /** By worker, its subscriber to each key's hub. */
  private readonly workers = new Map<number, Map<string, WorkerSubscriber>>()

  constructor(private readonly upstreamTls: UpstreamTls | undefined, private readonly send: (index: number, m: ListenToWorker) => void) {}

  /** A key's first login in some worker: what its listening backend logs in with. */
  known(m: KeyLogin) {
    this.logins.delete(m.key)
    this.logins.set(m.key, m)
    for (const key of this.logins.keys()) {
      if (this.logins.size <= LOGINS_KEPT) break
      if (!this.hubs.has(key)) this.logins.delete(key)
    }
  }

  hear(index: number, m: ListenToPrimary) {
    if (m.op === 'listen') {
      const hub = this.hubOf(m.key)
      if (!hub) return this.send(index, { edgepg: 'listen', op: 'listened', id: m.id, error: { message: 'the proxy has no login for this database to listen with', code: '08006' } })
      const sub = this.subscriberOf(index, m.key, true)!
      sub.channels.add(m.channel)
      hub.subscribe(sub, m.channel).then(
        () => this.send(index, { edgepg: 'listen', op: 'listened', id: m.id }),
        (err: Error & { code?: string }) => {
          this.drop(index, sub, [m.channel])
          this.send(index, { edgepg: 'listen', op: 'listened', id: m.id, error: { message: err.message, code: err.code } })
        }
      )
    } else {
      const sub = this.subscriberOf(index, m.key, false)
      if (sub) this.drop(index, sub, m.op === 'close' ? [...sub.channels] : [m.channel])
    }
  }

  private drop(index: number, sub: WorkerSubscriber, channels: string[]) {
    const hub = this.hubs.get(sub.key)
    for (const channel of channels) sub.channels.delete(channel), hub?.unsubscribe(sub, channel)
    if (!sub.channels.size && this.workers.get(index)?.get(sub.key) === sub) this.workers.get(index)!.delete(sub.key)
  }

  /** Worker `index` exited: what it listened on is given up. */
  gone(index: number) {
    for (const key of [...(this.workers.get(index)?.keys() ?? [])]) this.hear(index, { edgepg: 'listen', op: 'close', key })
    this.workers.delete(index)
  }

  close() {
    for (const hub of this.hubs.values()) hub.close()
    this.hubs.clear()
  }

  private subscriberOf(index: number, key: string, make: boolean): WorkerSubscriber | undefined {
    let subs = this.workers.get(index)
    if (!subs) {
      if (!make) return undefined
      this.workers.set(index, (subs = new Map()))
    }
    let sub = subs.get(key)
    if (!sub && make) subs.set(key, (sub = new WorkerSubscriber(key, (m) => this.send(index, m))))
    return sub
  }

  private hubOf(key: string): Hub | undefined {
    const known = this.hubs.get(key)
    if (known) return known
    const m = this.logins.get(key)
    if (!m) return undefined
    const hub = new Hub(ready(() => loginAs(m.target, this.upstreamTls, passedLogin(m))))
    this.hubs.set(key, hub)
    return hub
  }
}

/** A worker, as one subscriber to a key's hub in the primary. */
class WorkerSubscriber implements Subscriber {
  readonly channels = new Set<string>()
  constructor(readonly key: string, private readonly send: (m: ListenToWorker) => void) {}

  notify(n: Notification) {
    this.send({ edgepg: 'listen', op: 'note', key: this.key, pid: n.pid, channel: n.channel, payload: n.payload })
  }
  lost(err: Error) {
    this.send({ edgepg: 'listen', op: 'lost', key: this.key, message: err.message })
  }
  restored() {
    this.send({ edgepg: 'listen', op: 'restored', key: this.key })
  }
}

/** A worker's part: its hubs' listening backends, each the primary's for its key. */
export class SharedListening {
  private readonly byKey = new Map<string, ListenerEvents>()
  private readonly asked = new Map<number, (error?: { message: string; code?: string }) => void>()
  private nextId = 0

  constructor(private readonly send: (m: ListenToPrimary) => void) {}

  /** For a hub of `key` (Lenders' listenThrough). */
  through(key: string, events: ListenerEvents): ListeningBackend {
    this.byKey.set(key, events)
    return {
      listen: (channel) =>
        new Promise<void>((resolve, reject) => {
          const id = this.nextId++
          this.asked.set(id, (error) => (error ? reject(Object.assign(new Error(error.message), { code: error.code })) : resolve()))
          this.send({ edgepg: 'listen', op: 'listen', key, channel, id })
        }),
      unlisten: async (channel) => this.send({ edgepg: 'listen', op: 'unlisten', key, channel }),
      close: () => {
        if (this.byKey.get(key) === events) this.byKey.delete(key)
        this.send({ edgepg: 'listen', op: 'close', key })
      },
    }
  }

  hear(m: ListenToWorker) {
    if (m.op === 'listened') {
      this.asked.get(m.id)?.(m.error)
      return void this.asked.delete(m.id)
    }
    const events = this.byKey.get(m.key)
    if (m.op === 'note') events?.onNotification({ pid: m.pid, channel: m.channel, payload: m.payload })
    else if (m.op === 'lost') events?.onLost(new Error(m.message))
    else events?.onRestored?.()
  }
}
