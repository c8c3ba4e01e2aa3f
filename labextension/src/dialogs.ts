// The dialogs: a snapshot form, a typed confirmation, and the steps of an operation under way.
import { Dialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { h } from './dom';

const CONSISTENCY: Record<string, string> = {
  'application-consistent':
    'It will be application-consistent: the guest agent freezes the file systems while the disks are copied.',
  'crash-consistent':
    'It will be crash-consistent (the guest agent does not answer): like pulling the plug, files being written may be incomplete.',
  offline: 'The workstation is stopped: the snapshot copies its disks as they were left.'
};

/** Name and note of a new snapshot. */
export class SnapshotForm extends Widget implements Dialog.IBodyWidget<{ name: string; note: string }> {
  constructor(consistency: string) {
    super();
    this.addClass('kvs-form');
    this._name = h('input', {
      id: 'kvs-snapshot-name',
      placeholder: 'optional: lower case, digits and -',
      pattern: '[a-z0-9]([-a-z0-9]*[a-z0-9])?',
      autocomplete: 'off'
    }) as HTMLInputElement;
    this._note = h('input', { id: 'kvs-snapshot-note', placeholder: 'what state this is' }) as HTMLInputElement;
    this.node.append(
      h('label', { for: 'kvs-snapshot-name' }, 'Name'),
      this._name,
      h('label', { for: 'kvs-snapshot-note' }, 'Note'),
      this._note,
      h('p', { class: 'kvs-hint kvs-consistency' }, CONSISTENCY[consistency] ?? '')
    );
  }

  getValue(): { name: string; note: string } {
    return { name: this._name.value.trim(), note: this._note.value.trim() };
  }

  private _name: HTMLInputElement;
  private _note: HTMLInputElement;
}

/** What the user types to confirm: the workstation's name. */
export class TypedConfirmation extends Widget implements Dialog.IBodyWidget<string> {
  constructor(paragraphs: string[], expected: string) {
    super();
    this.addClass('kvs-form');
    this._input = h('input', { id: 'kvs-confirm', autocomplete: 'off', spellcheck: 'false' }) as HTMLInputElement;
    for (const text of paragraphs) {
      this.node.append(h('p', {}, text));
    }
    this.node.append(
      h('label', { for: 'kvs-confirm' }, 'Type ', h('code', {}, expected), ' to confirm'),
      this._input
    );
  }

  getValue(): string {
    return this._input.value.trim();
  }

  private _input: HTMLInputElement;
}

/** The steps of a restore, reset or stop, the current one marked. */
export class StepList extends Widget {
  constructor(intro: string) {
    super();
    this.addClass('kvs-steps');
    this._intro = h('p', {}, intro);
    this._list = h('ol', {});
    this.node.append(this._intro, this._list);
  }

  setSteps(labels: string[], current: number): void {
    this._list.replaceChildren(
      ...labels.map((label, index) =>
        h(
          'li',
          {
            class: index + 1 < current ? 'kvs-done' : index + 1 === current ? 'kvs-current' : 'kvs-todo',
            'aria-current': index + 1 === current ? 'step' : false
          },
          label
        )
      )
    );
  }

  private _intro: HTMLElement;
  private _list: HTMLElement;
}
