/**
 * The channels a pool key's sessions listen on, through one Listener (one Postgres backend) for
 * them all: a channel is LISTENed there while any session wants it, and each notification goes to
 * every session that does. The backend is opened with the first channel and closed with the last.
 */
import { Listener, type ListenerEvents, type ListeningBackend, type Notification } from './listener'
import type { Upstream } from '../upstream/connection'
import { PolicyChecks } from './policy'

/** A session listening through the hub. */
export interface Subscriber {
  notify(n: Notification): void
  /** The listening backend was lost: notifications sent from now until `restored` are not delivered. */
  lost(err: Error): void
  restored(): void
}

/** Where a hub listens: `login` a backend of its own by default; with --workers, the primary's (proxy/cluster/listening.ts). */
export type ListenThrough = (events: ListenerEvents) => ListeningBackend

export class Hub {
  private listener?: ListeningBackend
  private readonly channels = new Map<string, Set<Subscriber>>()

  /** --listen-policy's questions, on a connection of their own. */
  readonly checks: PolicyChecks

  constructor(login: () => Promise<Upstream>, private readonly through: ListenThrough = (events) => new Listener(login, events)) {
    this.checks = new PolicyChecks(login)
  }

  /** Sessions listening. */
  get sessions(): number {
    return this.subscribers().size
  }

  /** `sub` hears `channel` from the moment this resolves: Postgres has it registered (rejects with Postgres's error). */
  subscribe(sub: Subscriber, channel: string): Promise<void> {
    let subs = this.channels.get(channel)
    if (subs) return subs.add(sub), this.registered(channel)
    this.channels.set(channel, (subs = new Set([sub])))
    const listener = (this.listener ??= this.through(this))
    const registering = listener.listen(channel).catch((err) => {
      if (this.channels.get(channel) === subs) this.channels.delete(channel), this.idle()
      throw err
    })
    this.pending.set(channel, registering)
    const forget = () => this.pending.get(channel) === registering && this.pending.delete(channel)
    registering.then(forget, forget)
    return registering
  }

  /** LISTENs still being answered, by channel: a second subscriber waits for the first's. */
  private readonly pending = new Map<string, Promise<void>>()
  private registered(channel: string): Promise<void> {
    return this.pending.get(channel) ?? Promise.resolve()
  }

  unsubscribe(sub: Subscriber, channel: string) {
    const subs = this.channels.get(channel)
    if (!subs?.delete(sub) || subs.size) return
    this.channels.delete(channel)
    if (!this.idle()) this.listener?.unlisten(channel).catch(() => {}) // (a lost backend forgets it anyway)
  }

  /** No channel left: the backend is closed (true). */
  private idle(): boolean {
    if (this.channels.size || !this.listener) return false
    this.listener.close()
    this.listener = undefined
    return true
  }

  close() {
    this.channels.clear()
    this.idle()
    this.checks.close()
  }

  onNotification(n: Notification) {
    const subs = this.channels.get(n.channel)
    if (subs) for (const sub of subs) sub.notify(n)
  }

  onLost(err: Error) {
    for (const sub of this.subscribers()) sub.lost(err)
  }

  onRestored() {
    for (const sub of this.subscribers()) sub.restored()
  }

  private subscribers(): Set<Subscriber> {
    const all = new Set<Subscriber>()
    for (const subs of this.channels.values()) for (const sub of subs) all.add(sub)
    return all
  }
}
